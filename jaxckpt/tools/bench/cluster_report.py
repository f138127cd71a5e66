"""``jaxckpt bench cluster``: the per-process results made into figures, and the BENCHMARKS.md section.

A job's figure for one repeat is its slowest process's (the job goes on when every process has finished); every
figure is then the median with min-max spread over repeats. Ratios are of medians of this run, pair by pair.
Nothing here imports jax.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxckpt.tools.bench import report

PATHS = (("local", "jaxckpt, local: all trainers restarted, agents alive"),
         ("peers", "jaxckpt, via peers: a node lost with its memory (lost chunks rebuilt, by the restore or by the "
                   "replacement's agent)"),
         ("resharded", "jaxckpt, resharded onto another process count and mesh"),
         ("persistent", "jaxckpt, persistent tier (every agent's memory gone)"),
         ("orbax_standard", "Orbax StandardRestore, directory on disk, page cache dropped"),
         ("orbax_emergency", "Orbax emergency CheckpointManager, local checkpoints on RAM disk"),
         ("orbax_emergency_dp", "Orbax emergency CheckpointManager, the data-parallel half alone"))


def _slowest(per_process: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest process's time."""
    n = min(len(x) for x in per_process)
    return [max(x[i] for x in per_process) for i in range(n)]


def _sum_sources(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("sources", {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _sum_timelines(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One restore's timeline over every process: bytes summed, seconds of the slowest process, per phase;
    host-transport and collective bytes summed; the transport's rate: its bytes over the union of every
    process's fetch span (one host's monotonic clock), or, for results without spans, over the longest span."""
    tls = [r["timeline"] for r in rows if r.get("timeline")]
    if not tls:
        return {}
    phases: dict[str, dict[str, float]] = {}
    for t in tls:
        for name, p in t["phases"].items():
            q = phases.setdefault(name, {"nbytes": 0, "seconds": 0.0})
            q["nbytes"] += p["nbytes"]
            q["seconds"] = max(q["seconds"], p["seconds"])
    routes: dict[str, int] = {}
    for t in tls:
        for k, v in t.get("routes", {}).items():
            routes[k] = max(routes.get(k, 0), v)
    manifests: dict[str, int] = {}
    for t in tls:
        for k, v in t.get("manifests", {}).items():
            manifests[k] = manifests.get(k, 0) + v
    peer = phases.get("peer_fetches", {"nbytes": 0, "seconds": 0.0})
    out = {"phases": {name: {k: v for k, v in p.items() if v} for name, p in phases.items() if any(p.values())},
           "transport_bytes": sum(t["transport_bytes"] for t in tls),
           "collective_bytes": sum(t["collective_bytes"] for t in tls), "routes": routes}
    if manifests:  # results of runs before the restores reported them have none
        out["manifests"] = manifests
        out["widened"] = sum(t.get("widened", 0) for t in tls)
    spans = [t["peer_span"] for t in tls if t.get("peer_span")]
    union = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    seconds = union if union > 0 and len(spans) == sum(1 for t in tls if t["phases"].get("peer_fetches", {})
                                                        .get("nbytes")) else peer["seconds"]
    if peer["nbytes"] and seconds:
        out["transport_gbps"] = peer["nbytes"] / seconds / 1e9
        out["transport_span_s"] = seconds
    return out


def _process_bytes(rows: Sequence[Mapping[str, Any]]) -> int:
    """The most bytes one process restored (read from every source, the collective's included): what its
    memory copy floor is of."""
    return max((sum(int(v) for v in r.get("sources", {}).values()) for r in rows), default=0)


def _first_error(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The earliest error of a failed collective operation: the cause (the others fail because of it)."""
    errs = sorted((r.get("t", 0.0), r["error"]) for r in rows if "error" in r)
    return errs[0][1] if errs else None


def _policy_rows(saved: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> list[dict[str, Any]]:
    s = report.summarize
    rows = []
    for policy in policies:
        per = [r["policies"][policy] for r in saved]
        row: dict[str, Any] = {"policy": policy}
        base = [x for p in per for x in p["base_step_s"]]
        loop = [x for p in per for x in p["save_step_s"]]
        row["save_call_s"] = s([x for p in per for x in p["save_call_s"]])
        row["step_s"], row["step_with_saves_s"] = s(base), s(loop)
        row["step_ratio"] = row["step_with_saves_s"]["median"] / row["step_s"]["median"]
        pages = [p["pages"] for p in per if "pages" in p]
        worst = max(pages, key=lambda g: g["data_held_bytes"] + g["protect_held_bytes"])
        row["held_bytes_per_node"] = worst["data_held_bytes"] + worst["protect_held_bytes"]
        row["segments_per_node"] = worst["segments"]
        big = max(pages, key=lambda g: g["data_snapshot_bytes"] + g["protect_snapshot_bytes"])
        row["snapshot_bytes_per_node"] = big["data_snapshot_bytes"]
        row["extra_bytes_per_node"] = big["protect_snapshot_bytes"]
        row["extra_over_data"] = big["protect_snapshot_bytes"] / big["data_snapshot_bytes"]
        planned = [p["planned"] for p in per if "planned" in p]
        row["chosen"] = planned[0]["policies"] if planned else ["none"]
        if policy != "none" and planned:
            lags = _slowest([p["protect_lag_s"] for p in per])
            sent = planned[0]["sent_bytes_total"]
            row["commit_s"] = s(_slowest([p["commit_s"] for p in per]))
            row["protect_lag_s"] = s(lags)
            row["sent_bytes_total"] = sent
            row["replication_gbps"] = s([sent / t / 1e9 for t in lags]) if sent else None
            if all(p.get("pull_s") for p in per):  # the slowest node agent's pull of each repeat
                row["pull_s"] = s(_slowest([p["pull_s"] for p in per]))
            big = max(planned, key=lambda p: p["data_bytes"] + p["extra_bytes"])
            row["planned_data_bytes_per_node"] = big["data_bytes"]
            row["planned_extra_bytes_per_node"] = big["extra_bytes"]
            row["planned_extra_over_data"] = big["extra_bytes"] / big["data_bytes"]
            row["measured_over_planned_extra"] = row["extra_over_data"] / row["planned_extra_over_data"] \
                if big["extra_bytes"] else None
            par = [p for p in planned if p["parity_data_bytes"]]
            if par:
                row["parity_extra_over_parity_data"] = max(p["parity_extra_bytes"] / p["parity_data_bytes"]
                                                           for p in par)
                row["replica_nodes"] = par[0]["replica_nodes"]
        rows.append(row)
    return rows


def _bytecode_line(st: Mapping[str, Any]) -> str:
    bc = st.get("bytecode")
    if not bc:
        return ""
    if bc["written"]:
        return (" jaxckpt's modules were byte-compiled before the launches, as an installed package is (every "
                "relaunched process reads their `.pyc`).")
    return (" jaxckpt's modules could not be byte-compiled (its directories are not writable): every relaunched "
            "process compiled them, which an installed package does not.")


def _startup(row: Mapping[str, Any]) -> dict[str, Any]:
    """One relaunched process's ``Checkpointer()`` stage by stage (wall and CPU seconds; ``rest``: what no stage
    covers, the front end's own imports and set-up), its CPU seconds per recovery stage, and how long its node
    agent's hello waited for the recovery of the node's share."""
    su, stamps = row.get("startup") or {}, row["stamps"]
    create = stamps["created"] - stamps["target"]
    stages = dict(su.get("stages") or {})
    stages["rest"] = {"seconds": max(0.0, create - sum(v["seconds"] for v in stages.values())),
                      "cpu_s": max(0.0, (su.get("cpu_s") or {}).get("create", 0.0) - sum(v["cpu_s"] for v in stages.values()))}
    return {"process": row["process"], "create_s": create, "stages": stages, "cpu_s": su.get("cpu_s") or {},
            "recovery_wait_s": su.get("recovery_wait_s"),
            "agent_recovery": {k: v for k, v in (su.get("agent_recovery") or {}).items()
                               if k in ("state", "why", "error", "step", "bytes", "received", "seconds")}}


def _startups(rows: Sequence[Mapping[str, Any]], lost_node: int) -> dict[str, Any]:
    """The ``Checkpointer()`` breakdown of the process that finished it last (what the event's ``create_s`` ends
    with) and of the replacement node's processes (the lost node's, relaunched on empty memory)."""
    if not all("startup" in r for r in rows):
        return {}
    last = max(rows, key=lambda r: r["stamps"]["created"])
    return {"create_slowest": _startup(last),
            "create_replacement": [_startup(r) for r in rows if r.get("node") == lost_node]}


def _cpu_bound(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The relaunched processes' own CPU (every thread) from the end of their imports to the end of their restore
    (``Checkpointer()``, ``latest_step()``, restore): summed, what the machine's cores must run before the last
    restore ends when every process shares them, and the slowest process's, the bound when each node has its own."""
    per = [((r.get("startup") or {}).get("process_cpu_s") or {}) for r in rows]
    if not per or not all({"create", "latest", "restore"} <= set(c) for c in per):
        return {}  # runs before the process CPU was recorded
    own = [c["create"] + c["latest"] + c["restore"] for c in per]
    return {"cpu_sum_s": sum(own), "cpu_max_s": max(own)}


def _recovery(results: Mapping[str, Any], recoveries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    s = report.summarize
    events = []
    for ev in recoveries:
        rows = results["recovered"][f"{ev['kind']}{ev['cycle']}"]
        st = {k: max(r["stamps"][k] for r in rows) for k in ("entry", "target", "created", "opened", "restored",
                                                             "first_step")}
        events.append({"kind": ev["kind"], "cycle": ev["cycle"], "lost_node": ev["lost_node"],
                       "killed_at_step": ev["step"], "restored_step": rows[0]["step"],
                       "newest_protected_at_kill": ev["newest_protected"],
                       "newest_persisted_at_kill": ev["newest_persisted"],
                       "steps_lost": ev["step"] - rows[0]["step"], "recovery_s": st["first_step"] - ev["t_kill"],
                       "relaunch_s": st["entry"] - ev["t_kill"], "target_s": st["target"] - st["entry"],
                       "create_s": st["created"] - st["target"],
                       "latest_s": st["opened"] - st["created"],
                       "restore_s": st["restored"] - st["opened"], "first_step_s": st["first_step"] - st["restored"],
                       **_startups(rows, ev["lost_node"]), **_cpu_bound(rows)})
    out: dict[str, Any] = {"events": events}
    for kind in ("peers", "persistent"):
        ev = [e for e in events if e["kind"] == kind]
        out[kind] = {k: s([e[k] for e in ev]) for k in ("recovery_s", "relaunch_s", "target_s", "create_s",
                                                         "latest_s", "restore_s", "first_step_s")}
        for k in ("cpu_sum_s", "cpu_max_s"):
            if ev and all(k in e for e in ev):
                out[kind][k] = s([e[k] for e in ev])
    out["persistent_over_peers"] = out["persistent"]["recovery_s"]["median"] / out["peers"]["recovery_s"]["median"]
    return out


def aggregate(results: Mapping[str, Any], recoveries: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]
              ) -> dict[str, Any]:
    """The result document's figures from every process's raw samples."""
    s = report.summarize
    saved = results["save"]
    policies = _policy_rows(saved, spec["policies"])
    restore: dict[str, Any] = {}
    for name, rows in (("local", results["local"]), ("resharded", results["reshard"])):
        restore[name] = {"restore_s": s(_slowest([r["restore_s"] for r in rows])), "step": rows[0]["step"],
                         "sources": _sum_sources(rows), "processes": len(rows), "timeline": _sum_timelines(rows),
                         "process_bytes": _process_bytes(rows)}
    for kind in ("peers", "persistent"):
        jobs = [v for k, v in results["recovered"].items() if k.startswith(kind)]
        restore[kind] = {"restore_s": s([t for rows in jobs for t in _slowest([r["restore_s"] for r in rows])]),
                         "first_s": s([max(r["restore_s"][0] for r in rows) for rows in jobs]),
                         "step": jobs[0][0]["step"], "sources": _sum_sources(jobs[0]), "processes": len(jobs[0]),
                         "timeline": _sum_timelines(jobs[0]), "process_bytes": _process_bytes(jobs[0])}
    for key in ("copy_at_once_s", "made_from_host_s"):
        got = [r.get(key) for r in results["local"]]
        if got and all(got):  # results of runs before it lack it
            restore["local"][key] = s(_slowest(got))
    restore["orbax_standard"] = {"restore_s": s(_slowest([r["orbax_standard_restore_s"] for r in results["local"]])),
                                 "step": spec["orbax_std_step"], "processes": len(results["local"])}
    for key, rows, step in (("orbax_emergency", results["emergency"], spec["orbax_em_step"]),
                            ("orbax_emergency_dp", results["emergency_dp"], spec.get("orbax_em_dp_step"))):
        err = _first_error(rows)
        if err or len(rows) < len(saved):
            restore[key] = {"error": err or "no result (the job ended before this restore)", "restore_s": None}
        else:
            restore[key] = {"restore_s": s(_slowest([e["restore_s"] for e in rows])), "step": step,
                            "processes": len(rows)}
    ratios = {}
    std = restore["orbax_standard"]["restore_s"]["median"]
    for name in ("local", "peers", "resharded", "persistent"):
        ratios[f"orbax_standard_over_{name}"] = std / restore[name]["restore_s"]["median"]
    if restore["orbax_emergency"]["restore_s"] is not None:
        ratios["orbax_emergency_over_local"] = (restore["orbax_emergency"]["restore_s"]["median"] /
                                                restore["local"]["restore_s"]["median"])
    save = {"orbax_standard": {k: s(_slowest([r["orbax"]["standard"][k] for r in saved]))
                               for k in ("save_call_s", "total_s")}}
    for key, item in (("orbax_emergency", "emergency"), ("orbax_emergency_dp", "emergency_dp")):
        err = _first_error([r["orbax"][item] for r in saved])
        save[key] = {"error": err} if err else {k: s(_slowest([r["orbax"][item][k] for r in saved]))
                                                for k in ("save_call_s", "total_s")}
    keep = next(p for p in policies if p["policy"] == spec["keep_policy"])
    for k in ("orbax_standard", "orbax_emergency"):
        if "save_call_s" in save[k]:
            ratios[f"{k}_save_call_over_{spec['keep_policy']}"] = (save[k]["save_call_s"]["median"] /
                                                                   keep["save_call_s"]["median"])
    recovery = _recovery(results, recoveries)
    ratios["recovery_persistent_over_peers"] = recovery["persistent_over_peers"]
    return {"policies": policies, "restore": restore, "save": save, "recovery": recovery, "ratios": ratios}


# --------------------------------------------------------------------------------------------------- markdown
def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench cluster`` result (every number from the JSON)."""
    fm, fn, fs = report.fmt_ms, report.fmt_num, report.fmt_size
    st = result["setup"]
    parts = ["### `jaxckpt bench cluster`: protection, restore paths and recovery after a node loss, on simulated "
             "nodes, vs Orbax", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** A small state and one repeat of each node loss "
                  "on a shared machine: the shape of the tables, not the performance.", ""]
    parts += [f"Command: `{result['command']}`", "", report.machine_line(result), "",
              f"Setup: {st['nodes']} simulated nodes x {st['procs_per_node']} JAX process(es) x "
              f"{st['devices_per_proc']} CPU device(s), mesh {st['mesh'][0]}x{st['mesh'][1]} ('data' across nodes, "
              f"'model' within a process), one node agent per node (`store=\"shm\"` in {st.get('shm', '/dev/shm')}; "
              f"`keep=1`, the training jobs of the restore and recovery phases `keep=2`); state "
              f"{fs(st['state_bytes'])} in {st['arrays']} float32 arrays, half data-parallel (split over 'model', "
              f"replicated over the {st['nodes']} nodes) and half fully sharded. Each figure: median (min–max) over "
              f"{st['repeats']} repeats (step times: {st['steps']} steps per process, all processes pooled); a job's "
              f"time for one repeat is its slowest process's.{_bytecode_line(st)} Run took "
              f"{fn(st['wall_seconds'])} s.", ""]
    rows = []
    for p in result["policies"]:
        lag = fm(p["protect_lag_s"]) if p.get("protect_lag_s") else "–"
        gbps = fn(p["replication_gbps"]["median"]) + f" ({fs(p['sent_bytes_total'])})" \
            if p.get("replication_gbps") else ("0 B sent" if p.get("protect_lag_s") else "–")
        planned = (f"{fs(p['planned_extra_bytes_per_node'])} ({fn(p['planned_extra_over_data'] * 100)}%)"
                   if "planned_extra_bytes_per_node" in p else "–")
        rows.append([p["policy"], ", ".join(p["chosen"]), fm(p["save_call_s"]), fm(p["step_s"]),
                     fm(p["step_with_saves_s"]), f"{fn(p['step_ratio'])}x", lag, gbps,
                     fs(p["snapshot_bytes_per_node"]),
                     f"{fs(p['extra_bytes_per_node'])} ({fn(p['extra_over_data'] * 100)}%)"
                     if p["extra_bytes_per_node"] else "0 B", planned,
                     f"{fs(p['held_bytes_per_node'])} ({p['segments_per_node']})"])
    parts.append(report.table(["policy", "chosen per chunk", "save() ms", "step ms, no saves",
                               "step ms, save every step", "step with / without", "commit → protected ms",
                               "replication GB/s (bytes pulled per step)", "snapshot per node",
                               "protection per node (of snapshot)", "planned protection (of data)",
                               "agent tmpfs held per node (segments)"], rows))
    parts += ["", "Per node, measured: the tmpfs pages of one snapshot's segment and of one protection segment "
                  "(what the node's agent holds for a step); held: every segment the agent keeps (committed, being "
                  "written, pooled for reuse by the next saves). Planned: `ProtectionPlan.extra_bytes()` / "
                  "`data_bytes()` of the plan the run used. Replication: bytes the nodes pulled from each other for "
                  "one step (`sent_bytes()`) over commit → protected."]
    par = next((p for p in result["policies"] if p["policy"] == "parity"), None)
    if par and "parity_extra_over_parity_data" in par:
        want = 1 / (par["replica_nodes"] - 1)
        got, meas = par["parity_extra_over_parity_data"], par["measured_over_planned_extra"]
        tol = st["floors"]["parity_extra_tolerance"]
        ok = abs(got - want) <= tol * want and abs(meas - 1) <= tol
        parts += ["", f"Parity floor (issue 5, extra memory within {fn(tol * 100)}% of 1/(R-1)): the data-parallel "
                      f"arrays' parity stripes are {fn(got * 100)}% of the bytes they protect on each node, for "
                      f"1/(R-1) = {fn(want * 100)}% with R = {par['replica_nodes']} node replicas, and the protection "
                      f"pages measured are {fn(meas)}x the planned bytes: {'met' if ok else '**not met**'}. (Under "
                      f"`parity` the fully sharded half, held once, falls back to a copy on the next node.)"]
    parts += ["", "Restore (each checked bit for bit once):", ""]
    rs, q = result["restore"], result["ratios"]
    rows = []
    for key, label in PATHS:
        r = rs[key]
        if r.get("restore_s") is None:
            rows.append([label, "–", "**failed**: see below", "–", "–"])
            continue
        src = ", ".join(f"{k} {fs(v)}" for k, v in sorted(r.get("sources", {}).items())) or "–"
        ratio = q.get(f"orbax_standard_over_{key}")
        rows.append([label, str(r.get("step", "–")), fm(r["restore_s"]) + (
            f" (first {fm(r['first_s'])})" if "first_s" in r else ""), src, f"{fn(ratio)}x" if ratio else "–"])
    parts.append(report.table(["path", "step", "restore ms", "bytes read by source (all processes)",
                               "Orbax StandardRestore / this"], rows))
    parts += _timeline_section(result)
    for key, what in (("orbax_emergency", "the whole state"), ("orbax_emergency_dp", "the data-parallel half")):
        if rs[key].get("error"):
            parts += ["", f"Orbax emergency restore of {what} failed: `{_one_line(rs[key]['error'])}`."]
    if rs["orbax_emergency"].get("error") and not rs["orbax_emergency_dp"].get("error"):
        parts += ["", "Its restore takes the whole state from one replica slice's local checkpoint and broadcasts "
                      "it; a slice's local checkpoint holds only that slice's shards of the fully sharded arrays, so "
                      "the restore of a state with any array sharded over the replica axis fails, while the "
                      "data-parallel half alone restores (the row above)."]
    sv = result["save"]
    keep = next(p for p in result["policies"] if p["policy"] == st["keep_policy"])
    line = (f"Save, same state: jaxckpt `{st['keep_policy']}` save() {fm(keep['save_call_s'])} ms; Orbax "
            f"StandardSave to disk save() {fm(sv['orbax_standard']['save_call_s'])} ms, finished "
            f"{fm(sv['orbax_standard']['total_s'])} ms; ")
    for key, what in (("orbax_emergency", "Orbax emergency save() of the whole state"),
                      ("orbax_emergency_dp", "of the data-parallel half")):
        if "error" in sv[key]:
            line += f"{what} failed: `{_one_line(sv[key]['error'])}`; "
        else:
            line += f"{what} {fm(sv[key]['save_call_s'])} ms, finished {fm(sv[key]['total_s'])} ms; "
    ratio = q.get(f"orbax_emergency_save_call_over_{st['keep_policy']}")
    line = line.rstrip("; ") + (f" (Orbax emergency save() / jaxckpt save(): {fn(ratio)}x)." if ratio else ".")
    agent = ("each relaunched trainer's `Checkpointer()` starts its node's agent" if st.get("late_agent") else
             "each relaunched trainer starts its node's agent before it imports JAX (`jaxckpt.start_agent()`), and a "
             "replacement node's agent recovers the node's share meanwhile")
    parts += ["", line, "", f"Recovery after a node loss ({st['recoveries']} of each), SIGKILL to the end of the first "
                            f"step trained after the restore, relaunch, JAX start-up and compilation included; {agent}:",
              ""]
    rec = result["recovery"]
    rows = []
    for kind, label in (("peers", "jaxckpt, restore from the other nodes' agents"),
                        ("persistent", f"restart from the persistent tier (every {st['persist_interval']} steps)")):
        r = rec[kind]
        lost = sorted(e["steps_lost"] for e in rec["events"] if e["kind"] == kind)
        rows.append([label, fm(r["recovery_s"]), fm(r["relaunch_s"]), fm(r["target_s"]) if "target_s" in r else "–",
                     fm(r["create_s"]), fm(r["latest_s"]), fm(r["restore_s"]), fm(r["first_step_s"]),
                     ", ".join(str(x) for x in lost)])
    parts.append(report.table(["path", "kill → first step ms", "relaunch (start, JAX init) ms",
                               "the script's target built ms", "import jaxckpt.jax + Checkpointer() ms",
                               "latest_step() ms", "restore ms", "first step (with compile) ms", "steps lost"], rows))
    events = "; ".join(f"{e['kind']}: node {e['lost_node']} lost at step {e['killed_at_step']} (newest protected "
                       f"{e['newest_protected_at_kill']}, newest persisted {e['newest_persisted_at_kill']}), restored "
                       f"step {e['restored_step']}" for e in rec["events"])
    parts += _startup_lines(rec)
    parts += ["", f"Recovery from the persistent tier / from peers: {fn(rec['persistent_over_peers'])}x. Steps lost: "
                  f"trained before the kill and not restored (a save every step; protection and persists run behind "
                  f"the training loop and skip steps to keep up). Events: {events}. Ratios are of medians within this "
                  f"run."]
    return "\n".join(parts)


TIMELINE_PHASES = ("discover", "plan", "local_reads", "collective", "peer_fetches", "rebuild", "persistent_reads",
                   "assemble", "device_put")


def _timeline_section(result: Mapping[str, Any]) -> list[str]:
    """Per restore path: every phase's bytes (all processes) and seconds (slowest process), host-transport bytes
    per restore, and the transport's rate beside raw loopback TCP measured in the same run."""
    fn, fs = report.fmt_num, report.fmt_size
    rows = []
    for key, label in PATHS:
        t = result["restore"].get(key, {}).get("timeline")
        if not t:
            continue
        cells = []
        for name in TIMELINE_PHASES:
            p = t["phases"].get(name, {})
            nbytes, sec = p.get("nbytes", 0), p.get("seconds", 0.0)
            cells.append(f"{fs(nbytes) if nbytes else '–'} / {sec * 1e3:.0f}" if nbytes or sec else "–")
        routed = ", ".join(f"{v} {k}" for k, v in sorted(t.get("routes", {}).items())) or "–"
        rate = f"{fn(t['transport_gbps'])}" if t.get("transport_gbps") else "–"
        opened = ", ".join(f"{k} {v}" for k, v in sorted(t.get("manifests", {}).items())) or "–"
        if t.get("widened"):
            opened += f" ({t['widened']} widened)"
        rows.append([key, *cells, fs(t["transport_bytes"]), rate, routed, opened])
    if not rows:
        return []
    out = ["", "Restore timeline (one restore of each path: the last of the repeats with the agents alive and "
               "resharded, the relaunch's first after a node loss; bytes over all processes / ms of the slowest "
               "process, per phase; phases overlap):", "",
           report.table(["path", *TIMELINE_PHASES, "host transport bytes", "transport GB/s in restore",
                         "arrays by route (per process)", "manifests opened by holder kind (all processes)"], rows),
           "", "Manifests opened: where each restoring process read the manifests it planned from (its own "
               "memory, its node's agent, another node's, a rebuild, the persistent tier); a restore first opens "
               "its node's only and widens to every saving process's when those do not cover its target or a chunk "
               "has no good copy on the node (counted as widened)."]
    lb = result.get("loopback")
    if lb:
        between, within = lb.get("tcp_processes"), lb.get("tcp_threads")
        how = (f" (between {between['processes']} processes {fn(between['gbps'])} GB/s, within one process "
               f"{fn(within['gbps'])} GB/s; the faster is the ceiling)" if between and within else "")
        out += ["", f"Loopback, same run ({lb['tcp']['streams']} streams of {fs(lb['tcp']['bytes'])} in all): raw TCP "
                    f"{fn(lb['tcp']['gbps'])} GB/s{how}; the peer transport (ZeroMQ, "
                    f"{lb['transport']['streams']} clients reading {fs(lb['transport']['chunk_bytes'])} ranges) "
                    f"{fn(lb['transport']['gbps'])} GB/s = {fn(lb['transport_over_tcp'] * 100)}% of raw TCP. "
                    "Transport GB/s in restore: the host-transport bytes of all processes over the union of their "
                    "fetch spans."]
        out += _floor_lines(result, lb["tcp"]["gbps"])
        out += _issue_floors(result)
        out += _protection_floor_lines(result, lb["tcp"]["gbps"])
    return out


def _protection_floor_lines(result: Mapping[str, Any], tcp_gbps: float) -> list[str]:
    """Per policy that sends bytes, commit -> protected beside the time its bytes alone take at this run's raw
    loopback TCP rate, and the node agents' pull within it (the rest: the decision round, the slot, the
    announcement round that waits for the slowest node)."""
    rows = []
    for p in result["policies"]:
        sent, lag = p.get("sent_bytes_total"), (p.get("protect_lag_s") or {}).get("median")
        if not sent or not lag:
            continue
        floor = sent / (tcp_gbps * 1e9)
        pull = (p.get("pull_s") or {}).get("median")
        ms = lambda v: report.fmt_num(v * 1e3)  # noqa: E731
        rows.append([p["policy"], report.fmt_size(sent), ms(floor), ms(lag), f"{lag / floor:.2f}x",
                     ms(pull) if pull else "–", f"{pull / floor:.2f}x" if pull else "–"])
    if not rows:
        return []
    return ["", "Protection against the same floor: the bytes the nodes pull from each other for one step (all "
                "nodes at once) at the raw TCP rate above, commit → protected and the slowest node agent's pull "
                "(fetch, checks and XOR of the step's blocks) as multiples of it:", "",
            report.table(["policy", "bytes sent per step", "floor ms", "commit → protected ms", "lag / floor",
                          "node agent's pull ms (slowest)", "pull / floor"], rows)]


def _floor_lines(result: Mapping[str, Any], tcp_gbps: float) -> list[str]:
    """Per restore path, its floor on this machine: the larger of the time its host-transport bytes alone take at
    this run's raw loopback TCP rate and the time one process's memory copy (measured in the same run) takes for
    the most bytes one process restores; beside the restore and Orbax's restore."""
    rs = result["restore"]
    orbax = (rs.get("orbax_standard", {}).get("restore_s") or {}).get("median")
    mem = result.get("memcpy_gbps")
    rows = []
    for key, _label in PATHS:
        t, r = rs.get(key, {}).get("timeline"), (rs.get(key, {}).get("restore_s") or {}).get("median")
        if not t or not r:
            continue
        wire = t.get("transport_bytes", 0) / (tcp_gbps * 1e9)
        copy = rs[key].get("process_bytes", 0) / (mem * 1e9) if mem else 0.0
        floor = max(wire, copy)
        if not floor:
            continue
        ms = lambda v: report.fmt_num(v * 1e3)  # noqa: E731
        has = mem and "process_bytes" in rs[key]  # results of runs before the memory copy floor lack it
        rows.append([key, report.fmt_size(t.get("transport_bytes", 0)), ms(wire),
                     report.fmt_size(rs[key]["process_bytes"]) if has else "–", ms(copy) if has else "–",
                     "transport" if wire >= copy else "memory copy", ms(r), f"{r / floor:.2f}x",
                     f"{orbax / floor:.2f}x" if orbax else "–", f"{orbax / r:.2f}x" if orbax else "–"])
    if not rows:
        return []
    mem_line = (f" and the time one thread's memcpy ({report.fmt_num(mem)} GB/s), both measured in the same "
                f"run, takes for the most bytes one process restores (what one process's copy of its own state "
                f"takes)" if mem else " (this run measured no memory copy: its floor is the transport's)")
    return ["", "The floor of each restore path on this machine: the larger of its host-transport bytes (all "
                f"processes) at the raw TCP rate the probe above measured{mem_line}; restore and "
                "Orbax StandardRestore medians as multiples of it (its processes share the machine's cores: a "
                "restore below 1x means the probe ran slower than the restore's own transfers):", "",
            report.table(["path", "host transport bytes", "transport floor ms", "bytes per process (most)",
                          "memory copy floor ms", "floor", "restore ms", "restore / floor",
                          "Orbax StandardRestore / floor", "Orbax / restore"], rows)]


def _startup_lines(rec: Mapping[str, Any]) -> list[str]:
    """Where each recovery's ``Checkpointer()`` went, stage by stage, on the process that finished it last and on
    the replacement node's: wall ms (CPU ms); wall beyond CPU is waiting (a round for the slowest process, an
    agent's reply, the recovery of the node's share joined by the hello)."""
    fn = report.fmt_num

    def one(b: Mapping[str, Any]) -> str:
        st = "; ".join(f"{k} {fn(v['seconds'] * 1e3)} ({fn(v['cpu_s'] * 1e3)})" for k, v in b["stages"].items())
        cpu = b["cpu_s"]
        wait = b.get("recovery_wait_s")
        ar = b.get("agent_recovery") or {}
        rcv = (f"; its agent's recovery: {ar.get('state', '–')}" +
               (f" in {fn(ar['seconds'] * 1e3)} ms" if "seconds" in ar else "") +
               (f", the hello waited {fn(wait * 1e3)} ms for it" if wait is not None else "")) if ar else ""
        return (f"process {b['process']}: {fn(b['create_s'] * 1e3)} ms ({fn(cpu.get('create', 0) * 1e3)} CPU) = "
                f"{st}; then latest_step() {fn(cpu.get('latest', 0) * 1e3)}, restore {fn(cpu.get('restore', 0) * 1e3)}"
                f", first step {fn(cpu.get('first_step', 0) * 1e3)} ms CPU{rcv}")

    lines = []
    for e in rec["events"]:
        if "create_slowest" not in e:
            continue
        rep = "; replacement " + "; ".join(one(b) for b in e["create_replacement"]) if e["create_replacement"] else ""
        lines.append(f"- {e['kind']} (node {e['lost_node']} lost): last to finish `Checkpointer()`, "
                     f"{one(e['create_slowest'])}{rep}.")
    if not lines:
        return []
    return ["", "`Checkpointer()` of each relaunch, stage by stage, wall ms (CPU ms) (`Checkpointer.startup`): import "
                "(the front end's and the engine's modules), protection import, store (its import; the agent's hello, "
                "which joins a recovery of the node's share still running), protection (its set-up), the adoption: "
                "own steps (the store's held steps and their manifests), its rounds and scan (discover agents: a "
                "round; agent clients: the "
                "transport's import and a client per agent; agent listings: every agent's holdings; registered "
                "listings: protection's, its slots' headers read from every agent; restorable round: a round; agree "
                "held: a round), apply adoption (deletes, pins, the newest step's bytes made ready), persistent (the "
                "tier's set-up), rest (what no stage covers); "
                "wall beyond CPU is waiting, mostly for the slowest process at a round:", "", *lines]


def _issue_floors(result: Mapping[str, Any]) -> list[str]:
    """Issue 26's floors, each with its figures from this run and whether it is met."""
    rs, rec, fn = result["restore"], result["recovery"], report.fmt_num
    med = lambda d: (d or {}).get("median")  # noqa: E731
    local, orbax = med(rs["local"].get("restore_s")), med(rs["orbax_standard"].get("restore_s"))
    mem = result.get("memcpy_gbps")
    out = ["", f"Floors (issue 26; `Config.replicas={result['setup'].get('replicas', 'split')!r}`):"]
    if local and orbax:
        copy = rs["local"]["process_bytes"] / (mem * 1e9) if mem and "process_bytes" in rs["local"] else None
        ok = orbax / local >= 3 and (copy is None or local <= 1.3 * copy)
        out.append(f"- agents alive: restore {fn(local * 1e3)} ms, Orbax / this {fn(orbax / local)}x (floor >= 3x)" + (f", {fn(local / copy)}x one process's memory copy of the bytes it restores (floor "
                                f"<= 1.3x)" if copy else "") + f": {'met' if ok else '**not met**'}.")
        total = sum((rs["local"].get("sources") or {}).values())
        cores = result["machine"].get("usable_cores") or result["machine"].get("cores")
        together = med(rs["local"].get("copy_at_once_s"))
        if together:
            out.append(f"  - where this machine stops it: every process copying the bytes it restores at once "
                       f"(its {report.fmt_size(rs['local']['process_bytes'])}, all {rs['local']['processes']} "
                       f"processes on {cores} cores, measured in this run, slowest process) take "
                       f"{fn(together * 1e3)} ms = {fn(together / copy)}x one process's copy alone; the restore is "
                       f"{fn(local / together)}x that.")
        elif copy and total and cores:
            shared = total / (mem * 1e9) / cores
            out.append(f"  - where this machine stops it: every process's restored bytes ({report.fmt_size(total)}) "
                       f"copied once at that memcpy rate, over its {cores} cores, take {fn(shared * 1e3)} ms "
                       f"(restore / that {fn(local / shared)}x); each node on cores of its own, the floor is the one "
                       f"process's copy above.")
        made = med(rs["local"].get("made_from_host_s"))
        if made:
            out.append(f"  - JAX's own part: making the restored arrays again from host copies of their shards (one "
                       f"`make_array_from_callback` an array, every process at once, slowest process) takes "
                       f"{fn(made * 1e3)} ms; the restore is {fn(local / made)}x that.")
    peers = rec.get("peers", {})
    create, restore = med(peers.get("create_s")), med(peers.get("restore_s"))
    if local and orbax and create is not None and restore is not None:
        after = create + restore
        ok = after <= 1.3 * local and orbax / after >= 1.5
        out.append(f"- after a node loss: `Checkpointer()` + restore on the slowest process {fn(after * 1e3)} ms "
                   f"({fn(create * 1e3)} + {fn(restore * 1e3)}) = {fn(after / local)}x the agents-alive restore "
                   f"(floor <= 1.3x), Orbax / this {fn(orbax / after)}x (floor >= 1.5x): "
                   f"{'met' if ok else '**not met**'}.")
        total, own = med(peers.get("cpu_sum_s")), med(peers.get("cpu_max_s"))
        cores = result["machine"].get("usable_cores") or result["machine"].get("cores")
        latest = med(peers.get("latest_s")) or 0.0
        if total is not None and own is not None and cores:
            out.append(f"  - where this machine stops it: the relaunched processes' own CPU (every thread) for "
                       f"`Checkpointer()`, `latest_step()` and restore, {fn(total * 1e3)} ms in all, over its {cores} "
                       f"cores is {fn(total / cores * 1e3)} ms before the last restore can end (the agents' CPU "
                       f"not counted) against {fn((after + latest) * 1e3)} ms measured; each node on cores of its "
                       f"own, the bound is the slowest process's own CPU, {fn(own * 1e3)} ms = "
                       f"{fn(own / local)}x the agents-alive restore.")
    per = rec.get("persistent", {})
    keys = ("create_s", "latest_s", "restore_s")
    if all(med(peers.get(k)) is not None and med(per.get(k)) is not None for k in keys + ("first_step_s",)):
        extra = max(0.0, med(peers["first_step_s"]) - med(per["first_step_s"]))
        own = sum(med(peers[k]) for k in keys) + extra
        theirs = sum(med(per[k]) for k in keys) + max(0.0, med(per["first_step_s"]) - med(peers["first_step_s"]))
        fixed = med(peers.get("relaunch_s"))
        out.append(f"- kill → first step: jaxckpt's own share (Checkpointer(), latest_step(), restore, the first "
                   f"step's extra over the other path's) {fn(own * 1e3)} ms against the persistent restart's "
                   f"{fn(theirs * 1e3)} ms = {fn(own / theirs if theirs else float('inf'))}x (floor <= 0.5x): "
                   f"{'met' if theirs and own <= 0.5 * theirs else '**not met**'}; beside the fixed cost neither "
                   f"path controls, relaunch and JAX start {fn(fixed * 1e3) if fixed is not None else '–'} ms.")
    return out


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return (line[:limit] + "…") if len(line) > limit else line
