"""The ``jaxckpt agent`` command: its flags, and running a node agent (``daemon.Agent``) in the foreground."""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import logging
import os
import signal
import sys

from jaxckpt.backends.agent import heap, lifetime
from jaxckpt.backends.agent.daemon import MESSAGE_TIMEOUT_S, Agent
from jaxckpt.backends.agent.protocol import agent_dir, default_log_path, shm_base, stop_agent
from jaxckpt.config import PEER_SECURITY, Config
from jaxckpt.errors import AgentError, ConfigError, JaxckptError
from jaxckpt.node_identity import allocation, node_identity, parse_agent_dir_name

log = logging.getLogger("jaxckpt.backends.agent.daemon")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt agent --job ID [--dir DIR] [--node NAME] [--budget-bytes N] [--log PATH] [--wait | --stop]``."""
    p.add_argument("--job", required=True, help="job id (Config.job_id) this agent serves")
    p.add_argument("--dir", default="",
                   help="agent directory (Config.shm_dir; default $JAXCKPT_SHM_DIR, else <shm root>/jaxckpt-<uid>-"
                        "<job>[@slurm<id>]@<node>)")
    p.add_argument("--shm-root", default=None,
                   help="where the default agent directory is made (Config.shm_root; default $JAXCKPT_SHM_ROOT, "
                        "else /dev/shm): the trainers' setting, so that both find the same directory")
    p.add_argument("--node", default=None, help="this node's name (Config.node_name; default $JAXCKPT_NODE_NAME, "
                                                "else the scheduler's name for it, else the host name: `jaxckpt "
                                                "doctor` shows it)")
    p.add_argument("--wait", action="store_true",
                   help="if an agent already serves the directory, wait until it exits and take over (an agent run "
                        "as its own SLURM step beside trainers that spawned theirs) instead of exiting")
    p.add_argument("--stop", action="store_true",
                   help="ask the directory's agent to stop and free its memory, wait until it has, and exit")
    p.add_argument("--budget-bytes", type=int, default=0, help="cap on the node's snapshot memory (0: none)")
    p.add_argument("--log", default="", help="log file (default: in the temp directory, named after --dir)")
    p.add_argument("--peer-bind", default=None,
                   help="Config.peer_bind: address peers read this node's snapshots on (default $JAXCKPT_PEER_BIND, "
                        "else loopback; 'none': do not serve)")
    p.add_argument("--peer-security", default=None, choices=PEER_SECURITY,
                   help="Config.peer_security of the peer server (default $JAXCKPT_PEER_SECURITY, else auto: CURVE "
                        "off loopback)")
    p.add_argument("--transport", default=None,
                   help="Config.transport: the peer transport's registry name or module:Class (default "
                        "$JAXCKPT_TRANSPORT, else zmq)")
    p.add_argument("--agent-dirs", default=None,
                   help="Config.agent_dirs: where the job's other agents publish their peer files; an agent starting "
                        "on a node that holds nothing of the job recovers its node's share from them at once")
    p.add_argument("--peers", default=None,
                   help="Config.agent_peers: where the job's agents listen, host[:port],... (e.g. the scheduler's node "
                        "list); across machines, an agent starting on a node that holds nothing of the job asks them "
                        "for its node's share at once. Needs the job's shared JAXCKPT_PEER_TOKEN on every node")
    p.add_argument("--peer-port", type=int, default=None,
                   help="Config.agent_port: the port this agent serves peers on (default 0: an ephemeral one); the "
                        "port of --peers entries that name none")
    p.add_argument("--message-timeout-s", type=float, default=MESSAGE_TIMEOUT_S,
                   help="a request must arrive whole within this long of its first byte, else the connection is "
                        f"dropped (default {MESSAGE_TIMEOUT_S:g})")
    p.set_defaults(run=run_cli)


# flag -> the Config field it sets; a flag not given takes the field from the JAXCKPT_* environment, as the
# trainers' Config does (an agent run on its own, as a SLURM step or a DaemonSet, beside trainers told by
# variables: it must find their directory under their node name and serve their peers where they look).
FLAG_FIELDS = {"shm_root": "shm_root", "node": "node_name", "peer_bind": "peer_bind",
               "peer_security": "peer_security", "transport": "transport", "agent_dirs": "agent_dirs",
               "peers": "agent_peers", "peer_port": "agent_port"}


def agent_config(args: argparse.Namespace) -> Config:
    """The agent's Config: its flags over the ``JAXCKPT_*`` environment over the defaults (ConfigError if bad)."""
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items() if getattr(args, flag) is not None}
    if given.get("peer_bind") == "none":  # serves no peers: what it would bind is moot
        del given["peer_bind"]
    if args.dir:
        given["shm_dir"] = os.path.abspath(args.dir)
    return Config().with_env().replace(job_id=args.job, **given)


def run_cli(args: argparse.Namespace) -> int:
    """Run the agent in the foreground until SIGTERM or a stop, then end the process with its exit code (``--stop``
    returns)."""
    try:
        config = agent_config(args)
        directory = agent_dir(config)
    except ConfigError as e:  # a bad job id or shm root: said in one line, no traceback
        print(f"jaxckpt agent: ConfigError: {e}", file=sys.stderr)
        return 2
    if args.stop:
        try:
            stopped = stop_agent(directory, args.job)
        except JaxckptError as e:  # it answered but did not finish, or something else answers on its socket
            print(f"jaxckpt agent: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"jaxckpt agent: {'stopped the agent of' if stopped else 'no agent serves'} {directory}")
        return 0
    heap.fix_mmap_threshold()  # before anything big is allocated and freed
    log_path = args.log or default_log_path(directory)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    # O_NOFOLLOW and 0600: the default log path is predictable (under /tmp), so a planted symlink must not
    # redirect the agent's writes, and the log (names of jobs and steps) is the user's alone.
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        stream = os.fdopen(fd, "a", buffering=1)
    except OSError as e:  # a symlink (ELOOP) or an unwritable path: log to stderr rather than not start
        stream = sys.stderr
        print(f"jaxckpt agent: not logging to {log_path} ({e.strerror}); logging to stderr", file=sys.stderr)
    handler = logging.StreamHandler(stream)
    # kill -USR1 <agent pid>: every thread's stack to the log, the agent going on (what a stuck agent waits on)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    handler.setFormatter(logging.Formatter(f"%(asctime)s agent[{os.getpid()}] %(levelname)s %(message)s"))
    logging.getLogger("jaxckpt").addHandler(handler)
    if allocation():  # memory an ended allocation left on this node (agent/lifetime.py)
        # the default directories beside this one (under the trainers' shm_root when they spawned it with --dir)
        lifetime.sweep_ended(os.path.dirname(directory) if parse_agent_dir_name(os.path.basename(directory))
                             else shm_base(config))
    try:
        code = Agent(args.job, directory, node=node_identity(config).name, node_budget=args.budget_bytes,
                     peer_bind=None if args.peer_bind == "none" else config.peer_bind,
                     message_timeout_s=args.message_timeout_s, peer_security=config.peer_security,
                     transport=config.transport, agent_dirs=config.agent_dirs, agent_peers=config.agent_peers,
                     agent_port=config.agent_port).run(wait=args.wait)
    except AgentError as e:  # its directory refused or not makeable (owner, mode, permissions): one line, in its
        # log and on stderr (the CLI's handler), not a traceback
        log.error("agent of job %s in %s failed: AgentError: %s", args.job, directory, e)
        return 2
    except Exception:
        log.exception("agent of job %s in %s failed", args.job, directory)
        raise
    # The agent has freed or handed on its memory and closed its sockets; what is left is the interpreter's
    # teardown of its modules and threads (0.1-0.2 s), which whoever waits for this process to end (a stop, a
    # launcher, the next agent's --wait) would wait out for nothing. The exit handlers still run (logging's
    # flush among them): only the teardown is skipped.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
