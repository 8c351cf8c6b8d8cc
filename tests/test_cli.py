"""The ``ckptstore`` command line, from the user's side: wiring, exit codes, messages, keygen, demo
set-up, packaging. Library behaviour behind the commands is tested in the modules' own files."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptstore
from ckptstore.cli import main as cli_main
from conftest import REMOTES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("list", "show", "pin", "unpin", "gc", "drop", "scrub", "rekey", "keygen", "advise", "goodput", "demo")


# -- helpers ------------------------------------------------------------------------------------------------
def save(root, version, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    w = ckptstore.StorageWriter(str(root), step=seed, frame_size=4096, **kw)
    dcp.save({"w": torch.randn(6000, generator=g), "meta": {"seed": seed}}, checkpoint_id=version, storage_writer=w)


def cli(*args, **kw):
    return CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False, **kw)


def cli_json(*args):
    r = cli(*args, "--json")
    return r.exit_code, json.loads(r.stdout)


def python(code: str, *args, cwd=None, timeout=120, env=None):
    """Run ``code`` in a fresh interpreter that imports this checkout's ckptstore."""
    e = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=e)


BLOCK = """
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in BLOCKED or any(name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _Block())
"""


def blocked(modules, body: str) -> str:
    return f"BLOCKED = {set(modules)!r}\n" + BLOCK + textwrap.dedent(body)


def damage(root, version, name="r00000.ckd"):
    (att,) = os.listdir(os.path.join(root, "versions", version, "attempts"))
    p = os.path.join(root, "versions", version, "attempts", att, name)
    b = bytearray(open(p, "rb").read())
    b[len(b) // 2] ^= 0xFF
    open(p, "wb").write(bytes(b))
    return f"attempts/{att}/{name}"


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A local store with v1, v2, v3 (pristine; tests copy it)."""
    root = tmp_path_factory.mktemp("three") / "s"
    for i in (1, 2, 3):
        save(root, f"v{i}", i)
    return str(root)


@pytest.fixture
def store(three, tmp_path):
    import shutil

    root = tmp_path / "s"
    shutil.copytree(three, root)
    return str(root)


# -- explicit wiring; a broken command module fails loudly ---------------------------------------
def test_help_lists_every_command():
    r = cli("--help")
    assert r.exit_code == 0
    listed = {line.split()[0] for line in r.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert set(COMMANDS) <= listed, listed


@pytest.mark.parametrize("module", ["ckptstore.cli.cmd_gc", "ckptstore.cli.cmd_scrub", "ckptstore.cli.cmd_show"])
def test_a_broken_command_module_fails_the_cli_loudly(module):
    # before: cli.py imported ops_cli through importlib and skipped it on ImportError: gc, scrub, show
    # and pin vanished from --help and the CLI exited 0
    p = python(blocked({module, "ckptstore.ops_cli"}, """
        from ckptstore.cli import main
        main(["--help"], prog_name="ckptstore")
    """))
    assert p.returncode != 0, p.stdout
    assert "blocked by the test" in p.stderr


def test_cli_start_does_not_import_torch(tmp_path):
    (tmp_path / "empty").mkdir()
    p = python("""
import sys
from ckptstore.cli import main
try:
    main(["list", sys.argv[1]], prog_name="ckptstore")
except SystemExit as e:
    assert not e.code, e.code
print("TORCH" if any(m == "torch" or m.startswith("torch.") for m in sys.modules) else "NO-TORCH")
""", tmp_path / "empty")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "NO-TORCH"


def test_python_dash_m_runs_the_cli(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "--version"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ckptstore, version")


# -- no store is an error; an empty store is fine; '' is "no local tier" --------------------------
@pytest.mark.parametrize("cmd", [["list"], ["show", "{root}", "v1"], ["gc", "--dry-run"], ["scrub"]])
def test_missing_root_is_an_error(tmp_path, cmd):
    root = str(tmp_path / "typo")
    args = [a.format(root=root) for a in cmd]
    args = [args[0], root, *[a for a in args[1:] if a != root]]
    r = cli(*args)
    assert r.exit_code == 9, r.output
    assert "does not exist" in r.stderr and "typo" in r.stderr
    assert not os.path.exists(root)


def test_empty_existing_root_is_an_empty_store(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    for args in (["list"], ["gc", "--dry-run"], ["scrub"]):
        r = cli(args[0], root, *args[1:])
        assert r.exit_code == 0, r.output
    assert "no committed versions" in cli("list", root).stdout


def test_a_root_holding_only_ckptstores_own_files_is_an_empty_store(tmp_path):
    """A job's checkpoint folder before its first save holds ``events.jsonl`` (the manager's ``open``
    line) and maybe ``probes/``: an empty store (exit 0, before: exit 9 "not a store")."""
    for own in (["events.jsonl"], ["probes/r00000.ab12"], ["restores.jsonl"]):
        root = tmp_path / own[0].split("/")[0].replace(".", "_")
        for rel in own:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("{}\n")
        r = cli("list", root)
        assert r.exit_code == 0 and "no committed versions" in r.stdout, (own, r.output)
        assert ckptstore.Store(str(root)).versions() == []


def test_the_python_catalogue_checks_the_root_as_the_cli_does(tmp_path):
    """``Store("/path/with/typo").latest()`` was None (the README's load pattern then failed with
    AttributeError); now the same StoreNotFoundError as ``ckptstore list`` (exit 9)."""
    typo = tmp_path / "typo"
    with pytest.raises(ckptstore.StoreNotFoundError, match="does not exist"):
        ckptstore.Store(str(typo)).latest()
    assert not typo.exists()
    (tmp_path / "notes.txt").write_text("x")
    save(tmp_path / "ckpt", "v1", 1)
    with pytest.raises(ckptstore.StoreNotFoundError, match="holds no versions/.*ckpt"):
        ckptstore.Store(str(tmp_path)).versions()
    with pytest.raises(ckptstore.StoreNotFoundError, match="not a directory"):
        ckptstore.Store(str(tmp_path / "notes.txt")).get("v1")
    assert ckptstore.Store(str(tmp_path / "ckpt")).latest().version == "v1"
    (tmp_path / "empty").mkdir()
    assert ckptstore.Store(str(tmp_path / "empty")).latest() is None


def test_a_file_as_root_is_an_error(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    r = cli("list", f)
    assert r.exit_code == 9 and "not a directory" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_unreadable_root_is_an_error(tmp_path):
    root = tmp_path / "locked"
    root.mkdir()
    root.chmod(0)
    try:
        r = cli("list", root)
        assert r.exit_code == 7 and "permission denied" in r.stderr
    finally:
        root.chmod(0o700)


def test_empty_root_is_not_the_current_directory(store, tmp_path):
    # before: Store('') opened the current directory as the local tier
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "list", ""], capture_output=True, text=True,
                       cwd=store, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert p.returncode == 2, p.stdout
    assert "v1" not in p.stdout and "no --remote" in p.stderr


@pytest.mark.parametrize("remote_url", REMOTES, indirect=True)
def test_remote_prefix_that_is_no_store_is_an_error(tmp_path, remote_url):
    for args in (["list"], ["gc", "--dry-run"], ["scrub"], ["show", "v1"]):
        r = cli(args[0], "", "--remote", remote_url, *args[1:])
        assert r.exit_code == 9, r.output
        assert f"no ckptstore store at {remote_url.partition('://')[0]}://" in r.stderr


@pytest.mark.parametrize("remote_url", REMOTES, indirect=True)
def test_empty_root_with_remote_is_remote_only(store, tmp_path, remote_url):
    from ckptstore.tiers import make_remote

    s3_url = remote_url
    remote = make_remote(s3_url)
    for d, _dn, fns in os.walk(store):
        for f in fns:
            p = os.path.join(d, f)
            remote.put(os.path.relpath(p, store).replace(os.sep, "/"), open(p, "rb").read())
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "list", "", "--remote", s3_url, "--json"],
                       capture_output=True, text=True, cwd=store, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [(v["version"], v["tiers"]) for v in json.loads(p.stdout)["versions"]] == [
        (f"v{i}", ["remote"]) for i in (1, 2, 3)]
    r = cli("scrub", "", "--remote", s3_url)
    assert r.exit_code == 0 and "local" not in r.stdout


# -- messages ----------------------------------------------------------------------------------------
def test_scrub_lines_do_not_repeat_the_path(store):
    name = damage(store, "v2")
    first = cli("scrub", store, "--repair")
    again = cli("scrub", store)
    assert first.exit_code == again.exit_code == 10
    for out in (first.stdout, again.stdout):
        for line in out.splitlines():
            assert line.count("r00000.ckd") <= 1, line
        assert "marked: marked" not in out
    assert f"damaged: {name}: corrupt: frame " in again.stdout
    assert "[marked damaged now]" in first.stdout and "marked damaged: " in again.stdout


def test_show_does_not_call_damage_retention(store):
    damage(store, "v2")
    assert cli("scrub", store, "--repair").exit_code == 10
    out = cli("show", store, "v2").stdout
    assert "retention:" not in out
    assert "integrity:      marked DAMAGED" in out and "pinned:         no" in out
    assert out.count("r00000.ckd") == 1


def test_list_reports_a_bad_manifest_once(store):
    open(os.path.join(store, "versions", "v1", "manifest.json"), "w").write("{bad")
    r = cli("list", store)
    assert r.exit_code == 0
    assert r.stderr.count("versions/v1/manifest.json") == 1, r.stderr


def test_damaged_version_error_advises_repair_only_with_another_tier(store):
    damage(store, "v2")
    assert cli("scrub", store, "--repair").exit_code == 10
    st = ckptstore.Store(store)
    with pytest.raises(ckptstore.DamagedVersionError) as ei:
        st.check_not_damaged("v2", st.local)
    assert "--repair" not in str(ei.value) and "no other tier" in str(ei.value)


def test_a_damaged_newest_version_can_be_dropped(store):
    """The newest version, damaged with no other tier, could be neither repaired nor removed."""
    damage(store, "v3")
    assert cli("scrub", store, "--repair").exit_code == 10
    assert cli("gc", store, "--keep-last", "1", "--grace", "0").exit_code == 0
    assert "v3" in [v["version"] for v in cli_json("list", store)[1]["versions"]]  # gc never removes the newest
    r = cli("drop", store, "v3")  # no terminal, no --yes: refused, nothing removed
    assert r.exit_code == 2 and "--yes" in r.output
    # the listing it prints first is marked as a plan before the refusal (before: read as done)
    first = r.stdout.splitlines()[0]
    assert first.startswith("drop v3: ") and "plan only: nothing is removed without --yes" in first, r.stdout
    assert "nothing was removed" in r.stderr, r.stderr
    r = cli("drop", store, "v3", "--dry-run")
    assert r.exit_code == 0 and "uncommit" in r.stdout and "dry run" in r.stdout
    assert [v["version"] for v in cli_json("list", store)[1]["versions"]] == ["v2", "v3"]
    r = cli("drop", store, "v3", "--yes")
    assert r.exit_code == 0, r.output
    assert [v["version"] for v in cli_json("list", store)[1]["versions"]] == ["v2"]
    assert not os.path.exists(os.path.join(store, "versions", "v3"))
    assert cli("scrub", store).exit_code == 0
    assert cli("drop", store, "v3", "--yes").exit_code == 3  # gone
    save(store, "v3", 33)  # the name is free again
    assert ckptstore.Store(store).latest().version == "v3"


def test_drop_refuses_a_pinned_version_without_force(store):
    assert cli("pin", store, "v2").exit_code == 0
    r = cli("drop", store, "v2", "--yes")
    assert r.exit_code == 1 and "pinned" in r.output
    assert cli("drop", store, "v2", "--yes", "--force").exit_code == 0
    assert [v["version"] for v in cli_json("list", store)[1]["versions"]] == ["v1", "v3"]


# -- pins, durations, the gc plan ------------------------------------------------------------
def test_pin_note_is_shown_everywhere(store):
    assert cli("pin", store, "v1", "--note", "best run").exit_code == 0
    assert "pinned:         yes (best run)" in cli("show", store, "v1").stdout
    code, out = cli_json("show", store, "v1")
    assert out["pin_note"] == "best run" and out["per_tier"]["local"]["pin_note"] == "best run"
    code, out = cli_json("list", store)
    assert [(v["version"], v["pin_note"]) for v in out["versions"]] == [("v1", "best run"), ("v2", None), ("v3", None)]
    r = cli("gc", store, "--dry-run", "--keep-last", "1")
    assert "pin note: best run" in r.stdout
    code, out = cli_json("gc", store, "--dry-run", "--keep-last", "1")
    assert out["pin_notes"] == {"local": {"v1": "best run"}}


def test_unpin_of_an_unpinned_version_says_so(store):
    r = cli("unpin", store, "v1")
    assert r.exit_code == 0 and r.stdout.strip() == "v1 was not pinned; nothing changed"
    cli("pin", store, "v1")
    r = cli("unpin", store, "v1")
    assert r.exit_code == 0 and r.stdout.strip() == "unpinned v1"


def test_duration_options_fail_alike(store):
    a = cli("gc", store, "--keep-within", "7days")
    b = cli("gc", store, "--grace", "abc")
    assert a.exit_code == b.exit_code == 2
    ea = [ln for ln in a.stderr.splitlines() if ln.startswith("Error:")]
    eb = [ln for ln in b.stderr.splitlines() if ln.startswith("Error:")]
    assert ea == ["Error: Invalid value for '--keep-within': not a duration: '7days' (use e.g. 7d, 12h, 1d12h, 90m, 30s, 2w)"]
    assert eb == ["Error: Invalid value for '--grace': not a duration: 'abc' (use e.g. 7d, 12h, 1d12h, 90m, 30s, 2w)"]
    assert cli("gc", store, "--dry-run", "--keep-within", "7d", "--grace", "0").exit_code == 0


def test_gc_plan_keeps_survivors_apart_and_counts_version_copies(store):
    open(os.path.join(store, "versions", "v1", "manifest.json"), "w").write("{bad")  # its objects survive
    r = cli("gc", store, "--dry-run", "--keep-last", "1", "--grace", "0")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    removing = lines[lines.index("would remove:") + 1:]
    removing = removing[:next(i for i, ln in enumerate(removing) if not ln.startswith("  "))]
    assert removing and not any(ln.strip().startswith("keep") for ln in removing), r.stdout
    assert "left alone (not removed):" in lines
    assert lines[-1].startswith("1 version copy un-committed (1 in the local tier), ")


# -- keys, wrapping, demo help ---------------------------------------------------------------------
def test_keygen_writes_a_0600_key_file_and_never_overwrites(tmp_path):
    from ckptstore.codec.crypto import load_key_file

    f = tmp_path / "k"
    old = os.umask(0o022)
    try:
        r = cli("keygen", f)
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    text = f.read_bytes()
    assert text.endswith(b"\n") and len(base64.b64decode(text.strip(), validate=True)) == 32
    assert load_key_file(str(f)) == base64.b64decode(text.strip())
    r = cli("keygen", f)
    assert r.exit_code == 6 and "already exists" in r.stderr and f.read_bytes() == text
    r = cli("keygen")
    assert r.exit_code == 0 and len(base64.b64decode(r.stdout.strip())) == 32 and r.stdout.strip().encode() != text.strip()


@pytest.mark.parametrize("cmd", ["scrub", "rekey", "keygen"])
def test_key_file_format_is_in_help(cmd):
    out = " ".join(cli(cmd, "--help").stdout.split())
    assert "32 raw bytes, or their base64 on one line" in out


def test_wrong_key_hint_names_the_cli_options(tmp_path):
    from ckptstore.codec import crypto

    root = tmp_path / "e"
    save(root, "e1", 1, key=bytes(range(32)))
    wrong = tmp_path / "wrong"
    wrong.write_bytes(base64.b64encode(bytes(range(1, 33))) + b"\n")
    r = cli("scrub", root, "--deep", "--key-file", wrong)
    assert r.exit_code == 5  # the key's exit code (was 12)
    assert "key=" not in r.output and "(--key-file, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE)" in r.output
    assert crypto.KEY_SOURCES.startswith("key=")  # the library's own words are back after the command


def test_demo_console_does_not_wrap_in_a_pipe():
    p = python("""
from ckptstore.demo.orchestrate import make_console
c = make_console()
c.print("[bold green]PASS[/bold green]: " + "word " * 60, highlight=False)
c.rule("x")
""")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("PASS: word") and lines[0].count("word") == 60
    assert len(lines[1]) == 120


def test_demo_help_has_text_for_every_option():
    from ckptstore.demo.cli import demo

    bare = [p.name for p in demo.params if isinstance(p, __import__("click").Option) and not p.help]
    assert bare == []


# -- the demo extra; py.typed ---------------------------------------------------------------------
def test_demo_without_torchdata_says_how_to_install(tmp_path):
    out = tmp_path / "out"
    p = python(blocked({"torchdata"}, """
        import sys
        from ckptstore.cli import main
        main(["demo", "--out", sys.argv[1], "--steps", "4"], prog_name="ckptstore")
    """), out, timeout=90)
    assert p.returncode == 2, (p.stdout, p.stderr[-2000:])
    assert "pip install 'ckptstore[demo]'" in p.stderr and "torchdata" in p.stderr
    assert not out.exists()  # no work done


def test_demo_without_matplotlib_only_skips_the_plot():
    p = python(blocked({"matplotlib"}, """
        from ckptstore.demo.cli import check_extra
        print(check_extra(plot=True))
    """))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
    assert p.stderr.strip().splitlines() == [
        "note: matplotlib is not installed, so the plot is skipped (pip install 'ckptstore[demo]' adds it)"]


def test_package_ships_py_typed():
    import tomllib

    assert os.path.isfile(os.path.join(REPO, "ckptstore", "py.typed"))
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        py = tomllib.load(f)
    assert "py.typed" in py["tool"]["setuptools"]["package-data"]["ckptstore"]


# -- set-up scripts and packaging metadata --------------------------------------------------------
def test_setup_scripts_choose_torch_one_way():
    for name in ("setup.sh", "demo.sh"):
        path = os.path.join(REPO, "scripts", name)
        assert subprocess.run(["bash", "-n", path]).returncode == 0
        text = open(path).read()
        assert "CKPTSTORE_TORCH_INDEX" in text, name
    setup = open(os.path.join(REPO, "scripts", "setup.sh")).read()
    assert "Sourced by" not in setup and "--index-url" in setup
    demo = open(os.path.join(REPO, "scripts", "demo.sh")).read()
    assert "scripts/setup.sh" in demo  # one place installs torch


def test_license_is_an_spdx_string():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        py = tomllib.load(f)
    assert py["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in py["build-system"]["requires"])


def test_testing_doc_does_not_call_a_fixed_bug_known():
    text = open(os.path.join(REPO, "docs", "TESTING.md")).read()
    assert "known bug" not in text


# -- a first run that just works (README "The two commands"; the newcomer's findings) -------------------------
def test_a_directory_that_is_not_a_store_says_so_and_points_at_the_store(tmp_path):
    """``list`` on the folder above ``store/`` (the demo's ``demo-out/crash``) and on
    ``store/versions``: not "no committed versions", exit 0 (before), but exit 9 naming the store."""
    run = tmp_path / "crash"
    save(run / "store", "v1", 1)
    (run / "train.log").write_text("log\n")
    r = cli("list", run)
    assert r.exit_code == 9 and "not empty but holds no versions/" in r.stderr
    assert repr(str(run / "store")) in r.stderr  # named as ROOT was given (here absolute), wherever we run
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = cli("list", "crash")  # a relative ROOT: a relative hint, from the same directory
        assert r.exit_code == 9 and repr(os.path.join("crash", "store")) in r.stderr, r.stderr
    finally:
        os.chdir(old)
    r = cli("list", run / "store" / "versions")
    assert r.exit_code == 9 and f"the versions/ directory of the store {str(run / 'store')!r}" in r.stderr
    for cmd in (["scrub"], ["gc", "--dry-run"]):
        assert cli(*cmd[:1], run, *cmd[1:]).exit_code == 9
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("list", empty).exit_code == 0  # an empty directory is an empty store
    assert cli("list", run / "store").exit_code == 0


def test_json_errors_are_json_on_stdout(tmp_path):
    save(tmp_path, "v1", 1)
    for args, code, kind in ((["show", tmp_path, "nope"], 3, "VersionNotFoundError"),
                             (["list", tmp_path / "missing"], 9, "StoreNotFoundError"),
                             (["advise", "--mtbf", "0", "--cost", "1"], 2, "UsageError")):
        r = cli(*args, "--json")
        assert r.exit_code == code
        err = json.loads(r.stdout)["error"]  # before: nothing on stdout
        assert err["type"] == kind and err["exit_code"] == code and err["message"]
        assert "error" in r.stderr.lower()  # the human line stays on stderr


def test_advise_with_free_checkpoints_and_json_rounding():
    r = cli("advise", "--mtbf", "6h", "--cost", "0")
    assert r.exit_code == 0 and "every step" in r.stdout and "100.0%" in r.stdout  # before: "every 0.0 s ... 0.0%"
    r = cli("advise", "--mtbf", "6h", "--cost", "0", "--restart", "2m", "--step-time", "0.8")
    assert "every 1 step)" in r.stdout and "99.4%" in r.stdout
    _, out = cli_json("advise", "--mtbf", "6h", "--cost", "2.5")
    assert out["interval_s"] == 326.969 and out["goodput"] == 0.984863  # not 326.9689809635838


def test_one_behaviour_for_a_bad_key_however_given(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTSTORE_KEY", raising=False)
    monkeypatch.delenv("CKPTSTORE_KEY_FILE", raising=False)
    plain, enc = tmp_path / "plain", tmp_path / "enc"
    save(plain, "p1", 1)
    save(enc, "e1", 1, key=bytes(range(32)))
    bad = tmp_path / "bad"
    bad.write_text("not-base64!\n")
    wrong = tmp_path / "wrong"
    wrong.write_bytes(base64.b64encode(bytes(range(1, 33))) + b"\n")
    right = tmp_path / "right"
    right.write_bytes(base64.b64encode(bytes(range(32))) + b"\n")
    # an undecodable key: exit 5 at once, by any route (before: CKPTSTORE_KEY made an unencrypted store UNCHECKED, 12)
    for root in (plain, enc):
        assert cli("scrub", root, "--deep", "--key-file", bad).exit_code == 5
        r = cli("scrub", root, "--deep", env={"CKPTSTORE_KEY": "not-base64!"})
        assert r.exit_code == 5 and "CKPTSTORE_KEY is not valid base64" in r.stderr
        assert cli("scrub", root, "--deep", env={"CKPTSTORE_KEY_FILE": str(bad)}).exit_code == 5
    # a key that does not fit: 5 (before: 12), by any route
    assert cli("scrub", enc, "--deep", "--key-file", wrong).exit_code == 5
    assert cli("scrub", enc, "--deep", env={"CKPTSTORE_KEY_FILE": str(wrong)}).exit_code == 5
    assert cli("scrub", enc, "--deep", "--key-file", right).exit_code == 0
    # no key: still "could not check everything" (12)
    assert cli("scrub", enc, "--deep").exit_code == 12
    # a key nobody needs is said to be unused (before: silent)
    r = cli("scrub", plain, "--deep", "--key-file", right)
    assert r.exit_code == 0 and "is not used: no version checked is encrypted" in r.stderr
    r = cli("scrub", plain, "--key-file", right)
    assert r.exit_code == 0 and "only --deep decrypts" in r.stderr


def test_version_not_found_is_one_message_with_near_misses(tmp_path):
    for s in (18, 180):
        save(tmp_path, f"step-{s:06d}", s)
    msgs = []
    for args in (["show", tmp_path, "step-00018"], ["pin", tmp_path, "step-00018"],
                 ["drop", tmp_path, "step-00018", "--yes"], ["scrub", tmp_path, "--version", "step-00018"]):
        r = cli(*args)
        assert r.exit_code == 3
        msgs.append(r.stderr)
    assert len(set(msgs)) == 1, msgs  # before: three different wordings, no hint
    assert "did you mean one of 'step-000180', 'step-000018'?" in msgs[0]
    assert "did you mean" not in cli("show", tmp_path, "zzz").stderr


def test_show_objects_is_a_table(tmp_path):
    save(tmp_path, "v1", 1)
    lines = cli("show", tmp_path, "v1", "--objects").stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("OBJECT"))
    table = lines[head:head + 3]
    assert "1 frame " in "\n".join(table) + " " and "1 frames" not in "\n".join(table)
    cols = [line.index("XXH3") if "XXH3" in line else len(line) - 16 for line in table]
    assert len(set(cols)) == 1, table  # the digests start in one column


def test_single_process_examples_print_no_torch_warning(tmp_path):
    code = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp, ckptstore
warnings.simplefilter("default")
root = sys.argv[1]
dcp.save({"w": torch.ones(3)}, checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root))
sd = {"w": torch.zeros(3)}
dcp.load(sd, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(root))
print(int(sd["w"].sum()))
"""
    p = python(code, tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "3", p.stderr
    assert "torch.distributed is disabled" not in p.stderr  # before: once for the save, once for the load


def test_setup_installs_once_and_again_when_pyproject_changes(tmp_path):
    """``scripts/test.sh`` and ``scripts/demo.sh`` run ``scripts/setup.sh`` every time; it installs only
    when the hash of pyproject.toml and the C source or torch differs from the stamp, when extras that were never installed are
    asked for (then the union of those and the installed ones), or when the install is broken (before:
    pip ran on every call, ≈ 7 s; and demo.sh/test.sh alternating reinstalled every time). A fake venv
    whose ``python`` is this interpreter records what would be installed."""
    import hashlib

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    shim = venv / "bin" / "python"
    shim.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> {log}; exit 0; fi
        PYTHONPATH={REPO} exec {sys.executable} "$@"
        """))
    shim.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    # the stamp hashes pyproject.toml and the C sources the install compiles (ckptstore/codec/_planes.c, _huff.c)
    sources = [os.path.join(REPO, "pyproject.toml"), os.path.join(REPO, "ckptstore", "codec", "_planes.c"),
               os.path.join(REPO, "ckptstore", "codec", "_huff.c")]
    h = hashlib.sha256(b"".join(open(f, "rb").read() for f in sources)).hexdigest()
    h_pyproject_only = hashlib.sha256(open(sources[0], "rb").read()).hexdigest()
    env = {**os.environ, "VENV": str(venv), "CKPTSTORE_TORCH_VERSION": torch.__version__.split("+")[0]}
    env.pop("CKPTSTORE_TORCH_INDEX", None)
    base = f"pyproject={h} torch={env['CKPTSTORE_TORCH_VERSION']} index="
    (venv / ".ckptstore-setup").write_text(f"{base} extras=demo,test\n")

    def setup(*extras):
        return subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh"), *extras], env=env,
                              capture_output=True, text=True, timeout=120)

    assert setup("test,demo").returncode == 0
    assert not log.exists()  # stamp matches, install intact: nothing installed
    assert setup("demo").returncode == 0 and not log.exists()  # fewer extras than installed: nothing
    p = setup("test,lightning")  # an extra never installed: the union, stamped
    assert p.returncode == 0, p.stderr
    assert "-e .[demo,lightning,test]" in log.read_text()
    assert (venv / ".ckptstore-setup").read_text() == f"{base} extras=demo,lightning,test\n"
    log.unlink()
    assert setup("test").returncode == 0 and not log.exists()
    (venv / ".ckptstore-setup").write_text("pyproject=0000 torch=x index= extras=test\n")  # pyproject.toml changed
    assert setup("test").returncode == 0 and "-e .[test]" in log.read_text()
    log.unlink()
    # the stamp of an install before the C source changed (here: one that hashed pyproject.toml alone)
    (venv / ".ckptstore-setup").write_text(f"pyproject={h_pyproject_only} torch={env['CKPTSTORE_TORCH_VERSION']} index= extras=test\n")
    assert setup("test").returncode == 0 and "-e .[test]" in log.read_text()
