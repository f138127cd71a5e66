"""``jaxckpt.Config``: one dataclass for every front end, loadable from TOML and overridable by JAXCKPT_* env vars."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt.config")

STORES = ("memory", "shm")  # built into jaxckpt.registry; other names must be registered there
PROTECTIONS = ("none", "replica", "parity", "xor-group", "hybrid")
# Config.replicas: how an array replicated over data-parallel replicas is saved (jaxckpt.core.plan.plan_save).
REPLICAS = ("split", "whole")
# Config.peer_security: how peer connections (trainers' and node agents' snapshot servers) are protected.
PEER_SECURITY = ("auto", "curve", "insecure-token")
ENV_PREFIX = "JAXCKPT_"
MAX_JOB_ID = 128
MAX_NODE_NAME = 253  # a Kubernetes node name (a DNS subdomain) may be this long
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Config:
    """How snapshots are taken, where they live and how they are protected.

    Fields (all optional): ``store`` picks a backend by registry name; ``keep`` committed snapshots are held
    (plus one being written, so keep=1 is double-buffered); ``memory_budget_bytes`` caps the bytes a store
    holds (0 = unlimited); ``inflight_bytes`` bounds the device-to-host transfers a save starts in the
    background (where an accelerator has no pinned host memory: each array's device-side copy, then its transfer;
    where it has, every transfer is enqueued at ``save()``, as it must be to come before a donating step, and a
    save holds its share in pinned memory until the workers copy it: docs/deploy.md); ``workers`` host copy
    threads; ``max_pending_saves`` saves may be in flight before ``save()`` waits for the oldest.
    ``persistent_dir``: committed steps that are multiples of ``persistent_interval`` (0 = never) are also written
    there in the standard Orbax format, ``persistent_keep`` newest kept (see ``jaxckpt.persistent``).
    ``protection_bandwidth``: bytes per second the protection pulls of one process may take (0 = unlimited;
    one token bucket per process, kept by its node agent across pulls, with a burst of a tenth of a second,
    see ``jaxckpt.backends.agent.protection_pull``).
    """

    store: str = "memory"
    protection: str = "none"
    # Copies on other nodes for "replica" (and for data that "parity"/"hybrid" find on one node only); nodes per
    # group for "xor-group" (extra memory 1/(group-1)). See jaxckpt.protection.plan.
    protection_copies: int = 1
    protection_group: int = 4
    protection_bandwidth: int = 0
    # An array replicated over data-parallel replicas: "whole" keeps one whole copy on every node that holds it
    # (shared by the node's own replicas), so a restore with the agents alive reads only its own node's memory and
    # the other nodes' copies protect it (no parity); "split" (REFT) saves 1/R of it on each of its R replicas
    # (protection then adds parity). Whole is the default by measurement (BENCHMARKS.md, "Which replicas is the
    # default"): quiet, 512 MiB bench cluster, its restore was 35x faster with the agents alive and 2.5x after a
    # node loss, and bench stall's step with a save every step cost the same as split's; it holds (nodes holding
    # it) copies where split holds one plus its parity. A job short of host memory sets "split".
    replicas: str = "whole"
    keep: int = 1
    memory_budget_bytes: int = 0
    inflight_bytes: int = 256 << 20
    workers: int = 2
    max_pending_saves: int = 2
    chunk_bytes: int = 64 << 20
    job_id: str = "default"
    # The time-out of every cross-process round (jaxckpt.core.collective): the commit of a step, start-up
    # adoption, agent discovery, protection and persist decisions, the peer token. The leader waits this long for
    # the other processes, they wait twice as long for its result; then the round fails on every process with
    # one CoordinationError naming the late process. (The close barrier waits peer_timeout_s.)
    commit_timeout_s: float = 120.0
    persistent_dir: str = ""
    persistent_interval: int = 0
    persistent_keep: int = 3  # persisted steps kept in persistent_dir (Orbax max_to_keep)
    verify_on_restore: bool = True
    # Multi-process jobs serve snapshots to each other: shared token ("" = process 0 makes one and shares it
    # through the coordination service), listen address, and the time-out of every peer request.
    peer_token: str = dataclasses.field(default="", repr=False)
    peer_bind: str = "127.0.0.1"
    peer_timeout_s: float = 30.0
    # "auto": ZeroMQ CURVE (encrypted, both ends authenticated by key: jaxckpt.backends.curve) when peer_bind
    # leaves loopback, the token alone on loopback; "curve": always; "insecure-token": never, even off
    # loopback (the token then crosses the network in clear text in every request).
    peer_security: str = "auto"
    # The peer transport (jaxckpt.core.transport) of trainers and node agents, by its name in the registry's group
    # "transport" (jaxckpt.registry: "zmq", jaxckpt.backends.transport) or as "module:Class".
    transport: str = "zmq"
    # store="shm": the node agent's directory (socket, lock, shared-memory segments); "" = a directory per job and
    # node (and SLURM allocation) under /dev/shm (jaxckpt.node_identity.agent_dir_name).
    shm_dir: str = ""
    # Where the default agent directories above are made (Config.shm_dir, when set, is this job's wherever it is;
    # the sweep of ended allocations' directories still looks here): "" = /dev/shm (the temp directory without it).
    # A tmpfs an administrator mounted with huge=within_size holds the agent's segments in 2 MiB pages, so a
    # relaunched trainer maps its snapshot with 512x fewer page faults (docs/deploy.md, "Huge pages").
    shm_root: str = ""
    # The node (failure domain) of this process: "" = the scheduler's name for it (K8S_NODE_NAME, SLURMD_NODENAME)
    # or the host name (jaxckpt.node_identity). Processes of one node share its agent; protection keeps a node's
    # redundancy on other nodes.
    node_name: str = ""
    # Restore from node agents (jaxckpt.core.catalog): agent directories of the saving job's nodes that this process
    # can read (comma-separated, glob patterns allowed, e.g. "/dev/shm/jaxckpt-sim/node*"); this process's own
    # node agent is always used, and the processes of a job share what they found through the coordination
    # service. ``restore_workers`` chunk fetches run in parallel per process.
    agent_dirs: str = ""
    # Across machines (no directory to read): where the job's node agents listen, "host[:port],..." (the
    # scheduler's node list), and the port every agent of the job serves peers on (0: an ephemeral one). An agent
    # starting on a node that holds nothing of the job asks these addresses for its peers and recovers its node's
    # share from them (jaxckpt.backends.agent.rendezvous); both need the job's shared peer_token.
    agent_peers: str = ""
    agent_port: int = 0
    restore_workers: int = 4
    # Multi-process restores onto a target: arrays replicated over processes are formed by the framework's
    # collective (XLA, or torch's process group) from the share each node holds (jaxckpt.core.routes) instead of
    # fetched whole by every process over the host transport. Off by default: on CPU the collective (gloo) runs
    # over loopback TCP too and measured 2.5x slower than the fetch (BENCHMARKS.md, bench cluster); turn it on
    # where the device interconnect is faster than the hosts' network (GPUs, TPUs).
    restore_collective: bool = False
    # JAX's persistent compilation cache (jaxckpt.jax.compile_cache): a relaunched job loads its compiled step
    # from this directory instead of compiling it again. "" leaves JAX's own setting alone.
    compilation_cache_dir: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), _field_types()[f.name])
        if self.store not in STORES and ":" not in self.store:  # "module:Class" is imported at use time
            from jaxckpt.registry import registered_stores  # names only: imports no backend

            known = registered_stores()
            if self.store not in known:
                raise ConfigError(f"Config.store={self.store!r}: unknown store (known: {', '.join(sorted(known))}; "
                                  f"or 'module:Class'){_PEER_NOTE if self.store == 'peer' else ''}")
        if self.protection not in PROTECTIONS:
            raise ConfigError(f"Config.protection={self.protection!r}: expected one of {', '.join(PROTECTIONS)}")
        if self.replicas not in REPLICAS:
            raise ConfigError(f"Config.replicas={self.replicas!r}: expected one of {', '.join(REPLICAS)} (split: "
                              f"each replica saves 1/R of a replicated array; whole: each node keeps a whole copy)")
        if self.protection_copies < 1:
            raise ConfigError(f"Config.protection_copies={self.protection_copies!r}: must be at least 1")
        if self.protection_group < 2:
            raise ConfigError(f"Config.protection_group={self.protection_group!r}: must be at least 2")
        for name in ("keep", "workers", "max_pending_saves", "chunk_bytes", "inflight_bytes", "persistent_keep",
                     "restore_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Config.{name}={getattr(self, name)!r}: must be at least 1")
        for name in ("memory_budget_bytes", "persistent_interval", "protection_bandwidth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Config.{name}={getattr(self, name)!r}: must not be negative")
        for name in ("commit_timeout_s", "peer_timeout_s"):
            # NaN fails too: every wait needs a real time-out (and threading refuses huge ones with OverflowError).
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise ConfigError(f"Config.{name}={getattr(self, name)!r}: must be positive and at most "
                                  f"{MAX_TIMEOUT_S:g} (a week)")
        check_peer_security(self.peer_bind, self.peer_security)
        if not 0 <= self.agent_port < 65536:
            raise ConfigError(f"Config.agent_port={self.agent_port!r}: expected a port in 1..65535, or 0 (ephemeral)")
        if self.agent_peers:
            agent_peer_entries(self.agent_peers, self.agent_port)  # malformed: fails here, not on a replacement node
        if ":" not in self.transport:
            from jaxckpt.registry import registered_parts  # names only: imports no transport

            known = registered_parts("transport")
            if self.transport not in known:
                raise ConfigError(f"Config.transport={self.transport!r}: unknown peer transport (known: "
                                  f"{', '.join(sorted(known))}; or 'module:Class')")
        for name in ("shm_dir", "shm_root"):
            value = getattr(self, name)
            if value and not os.path.isabs(value):
                raise ConfigError(f"Config.{name}={value!r}: must be an absolute path")
        if self.node_name and (len(self.node_name) > MAX_NODE_NAME or any(c not in _JOB_ID_CHARS
                                                                          for c in self.node_name)):
            raise ConfigError(f"Config.node_name={self.node_name[:64]!r}: use letters, digits, '-', '_' and '.' "
                              f"only, at most {MAX_NODE_NAME} characters")
        if not self.job_id or any(c not in _JOB_ID_CHARS for c in self.job_id):
            raise ConfigError(f"Config.job_id={self.job_id!r}: use letters, digits, '-', '_' and '.' only")
        if len(self.job_id) > MAX_JOB_ID:  # it names files and directories (NAME_MAX 255 with our prefixes)
            raise ConfigError(f"Config.job_id={self.job_id[:16]!r}...: {len(self.job_id)} characters, at most "
                              f"{MAX_JOB_ID}")

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` applied (validated like the constructor)."""
        unknown = sorted(set(changes) - set(_field_types()))
        if unknown:
            raise ConfigError(f"unknown Config field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "dict") -> "Config":
        """A Config from a mapping of field names; unknown keys and wrong types raise ConfigError."""
        unknown = sorted(set(values) - set(_field_types()))
        if unknown:
            raise ConfigError(f"{source}: unknown Config key(s): {', '.join(unknown)}")
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, env: bool = True) -> "Config":
        """Load a TOML file (top-level keys, or a ``[jaxckpt]`` table), then apply JAXCKPT_* overrides."""
        import tomllib  # here: only a config file needs it (3-4 ms of a relaunched process's start-up otherwise)

        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
        if set(data) == {"jaxckpt"} and isinstance(data["jaxckpt"], dict):
            data = data["jaxckpt"]
        cfg = cls.from_dict(data, source=str(path))
        return cfg.with_env() if env else cfg

    def with_env(self, environ: Mapping[str, str] | None = None) -> "Config":
        """A copy with every ``JAXCKPT_<FIELD>`` variable applied; an unknown JAXCKPT_ variable is an error."""
        environ = os.environ if environ is None else environ
        types = _field_types()
        changes: dict[str, Any] = {}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX) or key in _env_not_fields():
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in types:
                raise ConfigError(f"environment variable {key}: no Config field {name!r}")
            changes[name] = _parse_env(key, raw, types[name])
        if changes:
            log.info("config overridden from environment: %s", ", ".join(sorted(changes)))
            try:
                return dataclasses.replace(self, **changes)
            except ConfigError as e:
                raise ConfigError(f"environment: {e}") from None
        return self


# The variables jaxckpt's launcher sets in every process it starts (jaxckpt.tools.node reads them): JAXCKPT_*
# names that are not Config fields, which the environment reader skips.
ENV_COORDINATOR = "JAXCKPT_COORDINATOR"  # host:port of the JAX coordination service (process 0 binds it)
ENV_PROCESS_ID = "JAXCKPT_PROCESS_ID"
ENV_PROCESS_COUNT = "JAXCKPT_PROCESS_COUNT"
ENV_DEVICES_PER_PROC = "JAXCKPT_DEVICES_PER_PROC"
ENV_NODE = "JAXCKPT_NODE"  # the simulated node's number; its name goes to Config.node_name (JAXCKPT_NODE_NAME)
ENV_NODE_COUNT = "JAXCKPT_NODE_COUNT"
ENV_LOCAL_RANK = "JAXCKPT_LOCAL_RANK"
ENV_PROCS_PER_NODE = "JAXCKPT_PROCS_PER_NODE"
ENV_LAUNCH_DIR = "JAXCKPT_LAUNCH_DIR"  # scratch folder shared by the job's processes
LAUNCH_ENV = (ENV_COORDINATOR, ENV_PROCESS_ID, ENV_PROCESS_COUNT, ENV_DEVICES_PER_PROC, ENV_NODE, ENV_NODE_COUNT,
              ENV_LOCAL_RANK, ENV_PROCS_PER_NODE, ENV_LAUNCH_DIR)



def _env_not_fields() -> frozenset[str]:
    """Variables in our namespace that configure other things than Config: the CLI's, the launcher's, the JAX
    front end's way to the buffers it views (``jaxckpt.jax.buffers``), the bound of the per-step records of
    every process (``jaxckpt.core.trim``, set by a short soak), and the devices benchmarks lay their state on
    (``jaxckpt.tools.bench.state``, set by ``bench device``)."""
    return frozenset({"JAXCKPT_LOG_LEVEL", "JAXCKPT_LAUNCH_SPEC", "JAXCKPT_JAX_PUBLIC_BUFFERS", "JAXCKPT_STEPS_KEPT",
                      "JAXCKPT_BENCH_DEVICES", *LAUNCH_ENV})


# The design card once listed "peer" as a store; it never was one.
_PEER_NOTE = ("; peers are not a store: every multi-process job serves its snapshots to the other processes "
              "over the peer transport, whichever store holds them")
_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def agent_peer_entries(spec: str, port: int) -> list[tuple[str, int]]:
    """``(host, port)`` of each entry of ``Config.agent_peers`` (``port`` where an entry names none); ConfigError
    on a malformed entry, or an entry without a port when ``port`` is 0."""
    out: list[tuple[str, int]] = []
    for raw in (p.strip() for p in spec.split(",")):
        if not raw:
            continue
        if raw.startswith("["):  # [IPv6] or [IPv6]:port
            host, _, p = raw[1:].partition("]")
            p = p.removeprefix(":")
        elif raw.count(":") == 1:
            host, _, p = raw.partition(":")
        else:  # a host name, an IPv4 address or a bare IPv6 address: no port
            host, p = raw, ""
        try:
            n = int(p) if p else port
        except ValueError:
            raise ConfigError(f"Config.agent_peers entry {raw!r}: the port {p!r} is not a number") from None
        if not host or not 0 < n < 65536:
            raise ConfigError(f"Config.agent_peers entry {raw!r}: expected host[:port] with a port in 1..65535"
                              + ("" if p else " (no port given and Config.agent_port is 0)"))
        if (host, n) not in out:
            out.append((host, n))
    return out


def is_loopback(host: str) -> bool:
    """Whether a bind address ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    h = host.strip().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a host name, a wildcard ("*") or an interface name: other hosts may reach it


def peer_uses_curve(bind: str, security: str) -> bool:
    """Whether peer servers bound to ``bind`` under ``Config.peer_security=security`` speak CURVE."""
    return security == "curve" or (security == "auto" and not is_loopback(bind))


def check_peer_security(bind: str, security: str) -> None:
    """ConfigError unless peers bound to ``bind`` are protected as ``security`` says and this pyzmq can do it."""
    if security not in PEER_SECURITY:
        raise ConfigError(f"Config.peer_security={security!r}: expected one of {', '.join(PEER_SECURITY)}")
    if peer_uses_curve(bind, security):
        import zmq  # only here: a job bound to loopback never needs it at Config()

        if not zmq.has("curve"):
            raise ConfigError(f"Config.peer_bind={bind!r} with peer_security={security!r} needs ZeroMQ CURVE, "
                              f"which this libzmq ({zmq.zmq_version()}) lacks; bind to loopback, install a "
                              f"pyzmq with CURVE, or opt out with peer_security='insecure-token' (the peer "
                              f"token then crosses the network in clear text)")


def _field_types() -> dict[str, type]:
    """Field name -> type (a copy of one computed once: get_type_hints took a third of Checkpointer() start-up)."""
    return dict(_hints())


@functools.lru_cache(maxsize=1)
def _hints() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _check_type(name: str, value: Any, typ: type) -> None:
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(f"Config.{name}={value!r}: expected {typ.__name__}, got {type(value).__name__}")


def _parse_env(key: str, raw: str, typ: type) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ is int:
            return int(raw.replace("_", ""))
        if typ is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r}: expected {typ.__name__}") from None
