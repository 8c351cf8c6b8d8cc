"""A torchtitan-shaped job (``tests/titan_standin.py``'s trainer through ckptstore's subclass) that
is sent SIGTERM at a step: run as ``python tests/titan_preempt_job.py BASE STEPS KILL_AT INTERVAL`` (one
process) or under ``torchrun`` (rank 0 signals itself). Each rank writes ``BASE/rank<r>.json``:
the first step it trained, the last step it reached and, after the signal, what ``Preempted`` said.
It leaves through ``ckptstore._groups.exit_process`` with the exit status of the loop (143 after a
preemption)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> int:
    import torch.distributed as dist

    import titan_standin as ts
    from ckptstore.integrations._titan_v0_3 import manager_class

    base, steps, kill_at, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = manager_class(ts.StandInCheckpointManager).Config(enable=True, interval=interval, keep_latest_k=0,
                                                            last_save_model_only=False)
    out = {"rank": rank, "reached": None, "t_signal": None}

    def on_step(step: int) -> None:
        out["reached"] = step
        if step == kill_at and rank == 0:
            out["t_signal"] = time.time()
            os.kill(os.getpid(), signal.SIGTERM)

    code = 0
    try:
        run = ts.train(cfg, steps, base_folder=base, on_step=on_step)
        out["start"] = run["start"]
    except SystemExit as e:  # ckptstore.Preempted
        out.update(exit=e.code, message=str(e), saved=getattr(e, "version", None), t_end=time.time())
        code = e.code if isinstance(e.code, int) else 1
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return code


if __name__ == "__main__":
    from ckptstore._groups import exit_process

    exit_process(main())
