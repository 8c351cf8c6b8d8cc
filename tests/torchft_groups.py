"""A torchft job for the tests of ``ckptstore.integrations.torchft``: a real lighthouse
(``torchft_lighthouse``, torchft's own binary) and replica groups as separate processes (gradients
averaged across groups with ``Manager.allreduce`` over torchft's ``ProcessGroupGloo`` on CPU), every
rank with a torchdata ``StatefulDataLoader`` over its own shard (torchft's ``DistributedSampler``)
and a :class:`~ckptstore.integrations.torchft.DurableTier`.

A group has ``ranks`` ranks (config): with more than one, its ranks are one ``torch.distributed``
job of their own (gloo; the default process group is the group's ranks, as under one torchrun per
group) and with ``fsdp`` the model is FSDP2-sharded over them (HSDP: FSDP inside a group, torchft
across groups; the cross-group allreduce runs on each rank's local shard of the gradients).

``python tests/torchft_groups.py CONFIG GROUP LAUNCH [RANK]`` runs one rank of one group
(``CONFIG``: a JSON file, see :func:`config`); it appends one JSON line per step to
``OUT/g<GROUP>.jsonl`` (rank 0; ``OUT/g<GROUP>.r<RANK>.jsonl`` for the others: the step, its loss as
``float.hex``, the sample ids of its batch, a ``torch.rand`` drawn at the step's start (``rand``: equal
to the uninterrupted run's when the RNG was restored exactly), whether its batch counted, the step's
seconds) and a
``final`` line, and ends through :func:`ckptstore._groups.exit_process`. The test side
(:class:`Job`) starts the lighthouse and the groups, kills and restarts them, and reads the lines.

Kill points (``kill``: ``{group: [step, where]}`` for the group's first launch, or
``{group: [[step, where, launch], ...]}``):
``"mid-step"`` — SIGKILL after the backward pass of that step, before ``optimizer.step()``;
``"before-allreduce"`` — SIGKILL after the backward pass of that step, before the cross-group
allreduce (the peers' allreduce fails: that step commits nowhere);
``"mid-save"`` — SIGKILL inside the main save of that step, after its objects are written, right
before its commit point (from the writer's ``commit_check``, which runs on the group's rank 0).
A fourth element ``rank`` kills only that rank of the group (default: every rank); :meth:`Job.wait`
then ends the group's other ranks, as torchrun does, before it launches the group again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = 1200
BATCH = 4
MAX_GROUPS = 3  # the sampler's shards: group g reads shard g whatever the number of groups


def config(**kw) -> dict:
    c = {"steps": 40, "interval": 5, "num_groups": 3, "pace_s": 0.0, "kill": {}, "remote": None,
         "endpoint_url": None, "enabled": True, "min_replicas": 2, "close_wait": None, "timeout_s": None,
         "barrier": None, "heartbeat_timeout_ms": 5000, "join_timeout_ms": 20000, "quorum_timeout_s": 60,
         "ranks": 1, "fsdp": False,
         "port": None, "transport": None, "peer_fails": None, "sync_quorum": False,
         "positions_every_s": None, "hold": None}
    c.update(kw)
    return c


# -- one group ------------------------------------------------------------------------------------
class Samples:
    """Sample ``i``: ``(i, x, y)`` with ``x`` drawn from a generator seeded with ``i``; ``n`` samples."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        g = torch.Generator().manual_seed(int(i))
        x = torch.randn(8, generator=g)
        return i, x, (x[:4].sum() - 0.5 * x[4:].sum()).reshape(1)


def _barrier(path: str, group: int, parties: int, timeout: float = 120.0) -> None:
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, f"ready.{group}"), "w").close()
    end = time.monotonic() + timeout
    while len([n for n in os.listdir(path) if n.startswith("ready.")]) < parties:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {path}: not every group started")
        time.sleep(0.05)


def _out_name(group: int, rank: int) -> str:
    return f"g{group}.jsonl" if rank == 0 else f"g{group}.r{rank}.jsonl"


def run_group(cfg: dict, group: int, launch: str, rank: int = 0) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchft.data import DistributedSampler
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from ckptstore.integrations.torchft import DurableTier, DurableTransport

    torch.set_num_threads(1)
    ranks = int(cfg.get("ranks") or 1)
    out = open(os.path.join(cfg["out"], _out_name(group, rank)), "a", buffering=1)
    if ranks > 1:  # the group's own torch.distributed job: its TCPStore is torchft's too
        port = int(os.environ["TFT_GROUP_PORT"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=dt.timedelta(seconds=60))
        store_port = port
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if ranks > 1 and cfg.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ranks,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=10, gamma=0.5)

    def load_sd(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])

    def user_sd():
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    t = dt.timedelta(seconds=20)
    transport = None
    if cfg.get("transport"):  # heal through ckptstore's DurableTransport (the tier registers the state)
        from torchft.checkpointing import HTTPTransport

        peer = HTTPTransport(timeout=t, num_chunks=0)
        if cfg.get("peer_fails") == [group, int(launch)]:  # no live peer can serve this launch
            def no_peer(*_a, **_k):
                raise ConnectionError("the peer died before it could send (test)")

            peer.recv_checkpoint = no_peer
        transport = DurableTransport(peer, prefer=cfg["transport"])
        load_sd = user_sd = None
    manager = Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=1, load_state_dict=load_sd, state_dict=user_sd,
                      checkpoint_transport=transport,
                      replica_id=f"g{group}", store_addr="127.0.0.1", store_port=store_port, rank=rank,
                      world_size=ranks,
                      lighthouse_addr=cfg["lighthouse"], timeout=t, quorum_timeout=dt.timedelta(seconds=cfg.get("quorum_timeout_s", 60)),
                      connect_timeout=dt.timedelta(seconds=10), hostname="127.0.0.1",
                      # FSDP2: a healing group loads the peer's state before the forward pass (torchft
                      # applies it eagerly then), never into parameters FSDP has unsharded mid-step
                      use_async_quorum=not ((ranks > 1 and cfg.get("fsdp")) or cfg.get("sync_quorum")))
    ddp = model  # gradients averaged below with manager.allreduce: torchft 0.2.0's DDP comm hook asserts
    # after an allreduce errored (a peer died mid-step), meta-pytorch/torchft #294
    optim = OptimizerWrapper(manager, inner)
    data = Samples(cfg.get("samples") or SAMPLES)
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=MAX_GROUPS, group_rank=rank,
                                 num_replicas=ranks, shuffle=True, seed=7, drop_last=True)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=0)
    tier = DurableTier(cfg["root"], manager, {"model": ddp, "optim": optim, "sched": sched}, group=group,
                       num_groups=cfg["num_groups"], loader=loader, remote=cfg["remote"],
                       endpoint_url=cfg["endpoint_url"], interval_steps=cfg["interval"], enabled=cfg["enabled"],
                       lighthouse=cfg["lighthouse"], timeout_s=cfg["timeout_s"], transport=transport,
                       **({} if cfg["positions_every_s"] is None else {"positions_every_s": cfg["positions_every_s"]}))
    kills = cfg["kill"].get(str(group)) or []
    if kills and not isinstance(kills[0], list):
        kills = [kills + ["0"]]
    kill = next((k[:2] for k in kills if k[2] == launch and (len(k) < 4 or int(k[3]) == rank)), None)
    if kill and kill[1] == "mid-save":
        check = tier._main._writer.commit_check

        def killing_check(version, check=check, target=f"step-{kill[0]}"):
            if version == target:
                os.kill(os.getpid(), signal.SIGKILL)
            return check(version)

        tier._main._writer.commit_check = killing_check
    if cfg.get("race_barrier"):  # two groups that both own step-5 reach its commit point together
        check = tier._main._writer.commit_check

        def racing_check(version, check=check):
            if version == "step-5":
                _barrier(cfg["race_barrier"], group, 2)
            return check(version)

        tier._main._writer.commit_check = racing_check
    if cfg.get("hold_commit"):  # hold the main save of that step at its commit point until the quorum failed
        check = tier._main._writer.commit_check

        def holding_check(version, check=check, target=f"step-{cfg['hold_commit']}"):
            if version == target:
                out.write(json.dumps({"hold": version}) + "\n")
                end = time.monotonic() + 120
                while time.monotonic() < end:
                    fut = manager._quorum_future
                    if fut is not None and fut.done() and fut.exception() is not None:
                        break
                    time.sleep(0.05)
            why = check(version)
            if version == target:
                out.write(json.dumps({"claim": why}) + "\n")
            return why

        tier._main._writer.commit_check = holding_check
    if cfg.get("barrier"):  # every group of a start() begins together (a relaunch finds the barrier passed)
        _barrier(cfg["barrier"], f"{group}.{rank}", cfg["num_groups"] * ranks)
    report = tier.resume()
    _write_resume(out, launch, rank, report)
    out.flush()
    hold = (cfg.get("hold") or {}).get(str(group))
    if hold and launch != "0":  # the test acts between this relaunch's resume() and its first step
        while not os.path.exists(hold):
            time.sleep(0.05)
    crit = torch.nn.MSELoss()
    try:
        _loop(cfg, manager, tier, ddp, optim, sched, crit, out, launch, kill)
    except Exception as e:
        out.write(json.dumps({"launch": launch, "error": f"{type(e).__name__}: {e}"}) + "\n")
        tier.wait()  # the save in flight finishes (or is refused) before this process ends
        raise
    t_end = time.perf_counter()
    if cfg.get("close_wait"):  # the test brings S3 back, then says so
        while not os.path.exists(cfg["close_wait"]):
            time.sleep(0.05)
    tier.close()
    # whether each committed save of the tier's two managers paused between the pieces of its bookkeeping
    paused = {k: [i.paused_s > 0 for i in m._saves.infos if i.local_commit_s is not None]
              for k, m in (("main", getattr(tier, "_main", None)), ("positions", getattr(tier, "_positions", None)))
              if m is not None}
    out.write(json.dumps({"launch": launch, "final": True, "stats": tier.stats(), "paused": paused,
                          "transport": dict(transport.stats) if transport is not None else None,
                          "close_s": time.perf_counter() - t_end}) + "\n")
    out.close()
    manager.shutdown(wait=False)
    if ranks > 1:
        dist.barrier()  # the group's ranks end together: no rank's store goes while a peer still reads it


def _write_resume(out, launch, rank, report, **extra) -> None:
    out.write(json.dumps({"launch": launch, "rank": rank, **extra,
                          "resume": {"kind": report.kind, "step": report.step, "version": report.version,
                                     "why": report.why, "writer": report.writer, "skipped": report.skipped,
                                     "loader": None if report.loader is None else vars(report.loader),
                                     "orphaned": report.orphaned, "seconds": report.seconds}}) + "\n")


def _loop(cfg, manager, tier, ddp, optim, sched, crit, out, launch, kill) -> None:
    import torch

    for ids, x, y in tier.batches():
        t0 = time.perf_counter()
        before = manager.current_step()
        drawn = float(torch.rand(()))  # a random op of the step: equal to the uninterrupted run's when the RNG is restored
        optim.zero_grad()
        loss = crit(ddp(x), y)
        loss.backward()
        if kill and kill[1] == "before-allreduce" and before + 1 == kill[0]:
            if cfg.get("settle"):  # the saves started so far are committed before the kill
                tier.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        for p in ddp.parameters():  # average over the participating groups (zeros from a healing one)
            g = p.grad
            manager.allreduce(getattr(g, "_local_tensor", g)).wait()  # FSDP2: this rank's shard
        if kill and kill[1] == "mid-step" and before + 1 == kill[0]:
            if cfg.get("settle"):  # the saves started so far are committed before the kill
                tier.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        optim.step()
        counted = manager.is_participating()
        if manager.current_step() != before:  # committed: the scheduler steps with it
            sched.step()
        t_sd = time.perf_counter()
        seen = getattr(tier, "last_restore", None)
        committed = tier.step_done()  # after everything of the step: the main save captures it
        if getattr(tier, "last_restore", None) is not seen:  # the live job it joined was lost: restored from the store
            _write_resume(out, launch, getattr(tier, "rank", 0), tier.last_restore, lost_join=True)
        dt_s = time.perf_counter() - t0
        out.write(json.dumps({"launch": launch, "step": manager.current_step(), "committed": committed,
                              "counted": bool(committed and counted), "loss": float(loss.detach()).hex(),
                              "ids": [int(i) for i in ids], "rand": drawn.hex(), "dt": dt_s, "sd": dt_s - (t_sd - t0)}) + "\n")
        if cfg["pace_s"] and (cfg.get("pace_always") or manager.num_participants() < cfg["num_groups"]):
            time.sleep(cfg["pace_s"])  # a group is away: slow down until it is back
        if manager.current_step() >= cfg["steps"]:
            break
    # the nice values of the threads that ran this rank's saves and of this (the training) thread
    nice = lambda tid: os.getpriority(os.PRIO_PROCESS, tid)  # noqa: E731
    out.write(json.dumps({"launch": launch, "main_nice": nice(threading.get_native_id()),
                          "save_nice": sorted({nice(t.native_id) for t in threading.enumerate()
                                               if t.name == "ckptstore-manager" and t.is_alive()})}) + "\n")


# -- the test side ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A lighthouse and the groups of one torchft job under ``tmp`` (a ``pathlib.Path``)."""

    def __init__(self, tmp, root, name: str = "job", **cfg) -> None:
        self.tmp = tmp
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = config(root=str(root), out=str(self.dir), **cfg)
        self.lighthouse = None
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}
        self.launches: dict[int, int] = {}

    def start_lighthouse(self) -> None:
        port = free_port()
        env = dict(os.environ, RUST_LOG="warn")
        self.lh_log = open(self.dir / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen(
            ["torchft_lighthouse", "--bind", f"127.0.0.1:{port}", "--min_replicas", str(self.cfg["min_replicas"]),
             "--join_timeout_ms", str(self.cfg["join_timeout_ms"]), "--heartbeat_timeout_ms", str(self.cfg["heartbeat_timeout_ms"]), "--quorum_tick_ms", "20"],
            stdout=self.lh_log, stderr=subprocess.STDOUT, env=env)
        self.cfg["lighthouse"] = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the lighthouse did not start")

    def start(self, groups=None, barrier: bool = True, **over) -> None:
        self.cfg.update(over)
        if barrier:
            self.cfg["barrier"] = str(self.dir / f"barrier-{time.monotonic_ns()}")
        with open(self.dir / "config.json", "w") as f:
            json.dump(self.cfg, f)
        for g in (range(self.cfg["num_groups"]) if groups is None else groups):
            self.launch(g)

    def launch(self, g: int) -> None:
        """Launch every rank of group ``g`` (a fresh rendezvous port per launch, as torchrun's)."""
        n = self.launches.get(g, -1) + 1
        self.launches[g] = n
        ranks = int(self.cfg.get("ranks") or 1)
        env = dict(os.environ, RUST_LOG="warn", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                   TFT_GROUP_PORT=str(free_port()))
        for r in range(ranks):
            log = open(self.dir / (f"g{g}.{n}.log" if r == 0 else f"g{g}.r{r}.{n}.log"), "ab")
            self.procs[(g, r)] = subprocess.Popen([sys.executable, os.path.join(HERE, "torchft_groups.py"),
                                                   str(self.dir / "config.json"), str(g), str(n), str(r)],
                                                  stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill_group(self, g: int) -> None:
        """SIGKILL every rank of group ``g`` still running (torchrun ends a group whose rank died)."""
        for (gg, r), p in list(self.procs.items()):
            if gg == g:
                p.kill()
                p.wait()
                del self.procs[(gg, r)]

    def wait(self, timeout: float = 300, restart_killed: bool = False) -> dict[int, int]:
        """Wait for every group; a group with a rank killed by SIGKILL has its other ranks killed and is
        launched again when ``restart_killed``. Returns ``{group: status}``: 0 when every rank exited
        with 0, else the first other status of its ranks."""
        end = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while self.procs:
            for (g, r), p in list(self.procs.items()):
                if self.procs.get((g, r)) is not p:  # ended with its group, or that group relaunched
                    continue
                rc = p.poll()
                if rc is None:
                    continue
                del self.procs[(g, r)]
                if rc == -signal.SIGKILL and restart_killed:
                    self.kill_group(g)
                    codes.pop(g, None)
                    self.launch(g)
                elif rc != 0 or g not in codes:
                    codes[g] = rc if codes.get(g, 0) == 0 else codes[g]
            if time.monotonic() > end:
                for p in self.procs.values():
                    p.kill()
                raise TimeoutError(f"groups still running after {timeout} s:\n{self.tails()}")
            time.sleep(0.05)
        return codes

    def tails(self, n: int = 30) -> str:
        out = []
        for f in sorted(self.dir.glob("g*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-n:]))
        return "\n".join(out)

    def lines(self, g: int, rank: int = 0) -> list[dict]:
        p = self.dir / _out_name(g, rank)
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()
        self.procs.clear()
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
            self.lighthouse = None
            self.lh_log.close()


def shard_order(group: int, rank: int = 0, ranks: int = 1) -> list[list[int]]:
    """The batches of rank ``rank`` (of ``ranks``) of group ``group`` in the order its loader yields
    them (epoch 0)."""
    from torch.utils.data import DataLoader
    from torchft.data import DistributedSampler

    sampler = DistributedSampler(Samples(), replica_rank=group, num_replica_groups=MAX_GROUPS, group_rank=rank,
                                 num_replicas=ranks, shuffle=True, seed=7, drop_last=True)
    return [[int(i) for i in ids] for ids, _x, _y in DataLoader(Samples(), batch_size=BATCH, sampler=sampler)]


if __name__ == "__main__":
    from ckptstore._groups import exit_process

    code = 0
    try:
        with open(sys.argv[1]) as f:
            run_group(json.load(f), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    except BaseException:  # noqa: BLE001 - printed, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    exit_process(code)
