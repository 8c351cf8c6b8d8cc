"""Run PyTorch's own DCP test files against ckptstore (FileSystemWriter/Reader swapped).

PyTorch's test files are not part of ckptstore: put them in a directory of your own (e.g. copies of
``test/distributed/checkpoint/test_file_system_checkpoint_cpu.py`` from the PyTorch release that
matches the installed torch) and run::

    PYTHONPATH=$PWD python tests/compat/run_torch_dcp_tests.py /tmp/torch_dcp_tests [-k EXPR]

Each file runs twice: with DCP's own FileSystemWriter/Reader (the baseline: cases that fail there
fail for reasons of the installed torch, not ckptstore) and with ckptstore swapped in by
``tests/compat/shim`` (a ``sitecustomize`` so that spawned ranks get the swap too). The report
lists every case with both outcomes and the totals; exit status 0 when every case that passes on
the baseline also passes with ckptstore, except those listed in ``EXPECTED_DIFFERENCES`` (each one a
deliberate difference documented in docs/TESTING.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# "Class::test" (matched at the end of the case id pytest's junit report gives: its classname carries
# the module's dotted path, which depends on where the files were copied) -> why ckptstore
# deliberately behaves differently (docs/TESTING.md, "PyTorch's own DCP tests")
EXPECTED_DIFFERENCES: dict[str, str] = {
    # e2e/test_e2e_save_and_load.py: saves model and optimizer, loads the model alone (fine: a whole
    # top-level entry may stay unread), then _load_state_dict_from_keys("optimizer.state"), which asks
    # for part of the "optimizer" entry and leaves its param_groups unread
    "TestE2ESaveAndLoad::test_partial_load": (
        "ckptstore refuses to leave keys of a top-level entry unread when the load asks for other keys of "
        "it (_load_state_dict_from_keys('optimizer.state') leaves optimizer.param_groups) unless "
        "allow_partial_load=True (StateDictKeysError; README 'Use it'), where DCP's reader drops them silently; "
        "loading the model alone, and PyTorch's FSDP recipe (the model, then load_sharded_optimizer_state_dict), "
        "work with the default reader"),
}


def expected_difference(cid: str) -> str | None:
    """Why case ``cid`` (``module.path.Class::test``) deliberately fails with ckptstore, or None."""
    for key, why in EXPECTED_DIFFERENCES.items():
        if cid == key or cid.endswith("." + key):
            return why
    return None


#: the last line of a Python traceback: ``module.Class: message`` for an exception class
_EXC_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)):(?: (.*))?$")
#: what PyTorch's multi-process test base says when a rank failed without reporting its exception
_GENERIC = ("Scalars are not equal", "Expected exit code", "Process 0 terminated", "exited with error code")


def rank_exception(text: str) -> str | None:
    """The exception a rank of a multi-process test died of, from the case's failure text and
    captured output: PyTorch's base class reports a rank that died with an uncaught ``BaseException``
    (DCP's ``CheckpointException``) only as ``AssertionError: Scalars are not equal!`` (its exit code)
    and the traceback is in the rank's output. Prefers a ckptstore error (DCP wraps it), else the last
    exception line that is not the base class's own assertion; None when there is none."""
    found = []
    for line in text.splitlines():
        m = _EXC_LINE.match(line)
        if m and not any(g in line for g in _GENERIC):
            found.append(line.strip())
    if not found:
        return None
    ours = [x for x in found if x.startswith("ckptstore.")]
    return (ours or found)[-1]


def run(files: list[str], shim: bool, extra: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "shim"), REPO] + [p for p in [env.get("PYTHONPATH")] if p] + [os.path.join(HERE, "fallback")]
    )
    env["CKPTSTORE_DCP_SHIM"] = "1" if shim else "0"
    probe = ("import torch.distributed.checkpoint as d, ckptstore; "
             "print(issubclass(d.FileSystemWriter, ckptstore.StorageWriter), issubclass(d.FileSystemReader, ckptstore.StorageReader))")
    active = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.split()
    if active != ([str(shim)] * 2):
        raise SystemExit(f"the ckptstore shim is {'not ' if shim else ''}active where it should {'' if shim else 'not '}be: {active}")
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
               "--rootdir", os.path.dirname(files[0]), "-o", "addopts=", "-o", "junit_logging=all",
               f"--junitxml={xml}", *extra, *files]
        subprocess.run(cmd, env=env, cwd=os.path.dirname(files[0]))
        out: dict[str, str] = {}
        if not os.path.exists(xml):
            return out
        for tc in ET.parse(xml).iter("testcase"):
            cid = f"{tc.get('classname')}::{tc.get('name')}"
            status = "passed"
            output = "\n".join((c.text or "") for c in tc if c.tag in ("system-out", "system-err"))
            for child in tc:
                if child.tag in ("failure", "error"):
                    status = "failed"
                    msg = (child.get("message") or "").strip().splitlines()
                    status += f" ({msg[0][:160]})" if msg else ""
                    real = rank_exception((child.text or "") + "\n" + output)
                    if real and (not msg or real not in msg[0]):
                        status += f"\n        rank's exception: {real[:400]}"
                elif child.tag == "skipped":
                    status = "skipped"
            out[cid] = status
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests_dir", help="directory holding PyTorch's DCP test files (test_*.py)")
    ap.add_argument("--shim-only", action="store_true", help="skip the baseline run")
    a, pytest_args = ap.parse_known_args()  # the rest goes to pytest (e.g. -k EXPR)
    a.pytest_args = pytest_args
    files = sorted(os.path.join(os.path.abspath(a.tests_dir), f) for f in os.listdir(a.tests_dir)
                   if f.startswith("test_") and f.endswith(".py"))
    if not files:
        print(f"no test_*.py in {a.tests_dir}", file=sys.stderr)
        return 2
    base = {} if a.shim_only else run(files, False, a.pytest_args)
    ours = run(files, True, a.pytest_args)
    ok = True
    print("\n== PyTorch DCP tests: DCP FileSystemWriter/Reader (baseline) vs ckptstore ==")
    for cid in sorted(set(base) | set(ours)):
        b, o = base.get(cid, "-"), ours.get(cid, "-")
        note = ""
        if b == "passed" and not o.startswith("passed"):
            why = expected_difference(cid)
            note = f"  [deliberate: {why}]" if why else "  [REGRESSION]"
            ok = ok and why is not None
        print(f"{cid}\n    baseline: {b}\n    ckptstore: {o}{note}")
    ran = [c for c in ours if ours[c] != "skipped"]
    passed = [c for c in ran if ours[c] == "passed"]
    base_passed = [c for c in base if base[c] == "passed"]
    print(f"\nckptstore: {len(ran)} cases run, {len(passed)} passed, {len(ran) - len(passed)} failed, "
          f"{len(ours) - len(ran)} skipped")
    if base:
        both = [c for c in base_passed if ours.get(c) == "passed"]
        print(f"baseline (DCP FileSystemWriter): {len(base_passed)} of {len(base)} passed; "
              f"ckptstore passes {len(both)} of those {len(base_passed)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
