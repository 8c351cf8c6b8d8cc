"""The ckptstore side of the torchft integration, as pure functions; imports nothing of torchft.

* Version names: the main checkpoint ``step-N`` (one per due step, written by one group), and each
  replica group's positions ``loader-g<G>-<N>`` (``G`` the group's *stable* index, ``N`` the
  torchft step of the newest position in it).
* :class:`Position` — one group's data-loader position (and RNG) after one torchft step; a positions
  save holds those of the due steps of the last few and the newest (:func:`due_positions`), so a save
  skipped while the previous one still ran loses none a restore asks for; :func:`pack_blob` lays out
  its loader and RNG state.
* :func:`choose_main` — which main version a cold start restores: the newest one every group that was
  active around it has saved its position for (docs/FORMAT.md, "torchft").
* :func:`loader_plan` — what each group's loader continues from, when the number of groups changed.
* :func:`job_is_live` — whether a starting group joins a live job (torchft heals it) or the whole
  job starts (ckptstore restores it), from the lighthouse's view; :func:`live_step` — that job's step.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import struct
from typing import Any, Callable, Iterable

MAIN_PREFIX = "step-"
_LOADER = re.compile(r"loader-g(\d+)-(\d+)")
_MAIN = re.compile(re.escape(MAIN_PREFIX) + r"(\d+)")


def loader_prefix(group: int) -> str:
    return f"loader-g{int(group)}-"


def parse_loader_version(name: str) -> tuple[int, int] | None:
    """``loader-g<G>-<N>`` → ``(G, N)``, else None."""
    m = _LOADER.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def main_step(name: str) -> int | None:
    m = _MAIN.fullmatch(name)
    return None if m is None else int(m.group(1))


@dataclasses.dataclass(frozen=True)
class Position:
    """One group's position after torchft step ``step``: ``batches`` its loader has delivered into
    committed steps (the group's own count, across runs), ``participated`` whether its batch went into
    that step, ``blob`` the loader's ``state_dict()`` and the RNG states (:func:`pack_blob`)."""

    step: int
    batches: int
    participated: bool
    blob: bytes


_BLOB_MAGIC = b"CKLP\x03"  # a position blob (docs/FORMAT.md, "torchft")
_BLOB_MAGIC_2 = b"CKLP\x02"  # the layout before: no loader-encoding byte (a torch.save), still read
_U32 = struct.Struct("<I")
_PYRNG_HEAD = struct.Struct("<iI")
_PYRNG_TAIL = struct.Struct("<Bd")
_LOADER_TORCH, _LOADER_JSON = 0, 1  # how the loader state is encoded
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)
_WORDS: dict[int, struct.Struct] = {}  # "<NI" by N: Python's Mersenne Twister state is 625 words


def _plain(obj: Any) -> bool:
    """Whether ``obj`` comes back from JSON as it is: dicts with str keys, lists, str, int, bool,
    None and finite floats (a tuple, an int key, a tensor or a numpy scalar would not)."""
    t = type(obj)
    if t is dict:
        return all(type(k) is str and _plain(v) for k, v in obj.items())
    if t is list:
        return all(_plain(v) for v in obj)
    if t is float:
        return math.isfinite(obj)
    return t is str or t is int or t is bool or obj is None


def pack_blob(loader_state: Any, torch_rng: Any, python_rng: tuple) -> bytes:
    """A position's ``blob``: the loader's ``state_dict()`` and the RNG states after a step, laid out
    as docs/FORMAT.md ("torchft") gives it: ``CKLP\\x03``; the loader state's encoding (u8: 1 = JSON,
    when the state is plain — :func:`_plain`, the common case of a sampler's counters; 0 = a
    ``torch.save`` of pickle protocol 2, read back with ``weights_only=True``: a state holding a
    tensor, a tuple, ...) and its bytes after their u32 length; the torch RNG state
    (``torch.get_rng_state()``, uint8) after its u32 length; then Python's ``random.getstate()`` as
    i32 version, u32 count, that many u32 words, u8 "has gauss_next", f64 gauss_next. About 15 µs
    a step with a plain loader state (a ``torch.save`` of it alone: 19 µs; of the whole, zip
    container: 0.6-0.8 ms)."""
    if _plain(loader_state):
        kind, loader = _LOADER_JSON, _JSON.encode(loader_state).encode()
    else:
        import torch

        buf = io.BytesIO()
        torch.save(loader_state, buf, _use_new_zipfile_serialization=False)
        kind, loader = _LOADER_TORCH, buf.getvalue()
    rng = torch_rng.numpy().tobytes()
    version, words, gauss = python_rng
    packer = _WORDS.get(len(words))
    if packer is None:
        packer = _WORDS[len(words)] = struct.Struct(f"<{len(words)}I")
    return b"".join((_BLOB_MAGIC, bytes((kind,)), _U32.pack(len(loader)), loader, _U32.pack(len(rng)), rng,
                     _PYRNG_HEAD.pack(int(version), len(words)), packer.pack(*words),
                     _PYRNG_TAIL.pack(gauss is not None, 0.0 if gauss is None else float(gauss))))


def unpack_blob(blob: bytes) -> dict:
    """Inverse of :func:`pack_blob`: ``{"loader": state, "rng": {"torch": uint8 tensor, "python":
    tuple}}``; also reads the layouts before (``CKLP\\x02``: no encoding byte, the loader state a
    ``torch.save``; one ``torch.save`` of that dict, zip container). Raises
    :class:`~ckptstore.errors.IntegrityError` when ``blob`` is none of them."""
    import torch

    from ..errors import IntegrityError

    blob = bytes(blob)
    if not blob.startswith((_BLOB_MAGIC, _BLOB_MAGIC_2)):
        try:
            got = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable blob is the same error
            raise IntegrityError(f"a loader position's blob ({len(blob)} bytes) is unreadable: {e}") from e
        if not isinstance(got, dict) or "loader" not in got or "rng" not in got:
            raise IntegrityError(f"a loader position's blob ({len(blob)} bytes) has no loader and RNG state")
        return got
    try:
        at = len(_BLOB_MAGIC)
        kind = _LOADER_TORCH
        if blob.startswith(_BLOB_MAGIC):
            kind = blob[at]
            at += 1
        (n,) = _U32.unpack_from(blob, at)
        at += 4
        if at + n > len(blob):
            raise ValueError("truncated loader state")
        if kind == _LOADER_JSON:
            loader = json.loads(blob[at : at + n])
        elif kind == _LOADER_TORCH:
            loader = torch.load(io.BytesIO(blob[at : at + n]), weights_only=True)
        else:
            raise ValueError(f"unknown loader state encoding {kind}")
        at += n
        (n,) = _U32.unpack_from(blob, at)
        at += 4
        rng = torch.frombuffer(bytearray(blob[at : at + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        if rng.numel() != n:
            raise ValueError("truncated torch RNG state")
        at += n
        version, count = _PYRNG_HEAD.unpack_from(blob, at)
        at += _PYRNG_HEAD.size
        words = struct.unpack_from(f"<{count}I", blob, at)
        at += 4 * count
        has_gauss, gauss = _PYRNG_TAIL.unpack_from(blob, at)
        at += _PYRNG_TAIL.size
    except Exception as e:  # noqa: BLE001 - struct.error, a truncated torch.save: the same error
        raise IntegrityError(f"a loader position's blob ({len(blob)} bytes) is truncated or malformed: {e}") from e
    if at != len(blob) or has_gauss > 1:
        raise IntegrityError(f"a loader position's blob ({len(blob)} bytes) is malformed: {len(blob) - at} bytes "
                             "after its last field")
    return {"loader": loader, "rng": {"torch": rng, "python": (version, words, gauss if has_gauss else None)}}


def due_positions(history: Iterable[Position], interval: int) -> list[Position]:
    """The positions of ``history`` (oldest first) that a positions version keeps: for every due step
    D (``D % interval == 0``) the history spans, the one :func:`position_at` returns for D, and the
    newest — every position a cold start, a heal or a join asks a positions version for (they ask at
    main steps, which are due steps, or for the newest). Of equal steps the first is kept, as
    :func:`position_at` and ``max`` take it."""
    h = list(history)
    keep: list[Position] = []
    nxt = None  # the next greater step after the position looked at
    for i in range(len(h) - 1, -1, -1):
        p = h[i]
        if i and h[i - 1].step == p.step:
            continue
        first_due = -(-p.step // interval) * interval
        if nxt is None or first_due < nxt:
            keep.append(p)
        nxt = p.step
    keep.reverse()
    return keep


def pack_history(history: Iterable[Position]) -> bytes:
    """The bytes of a positions save (``torch.save`` of plain lists; ``weights_only`` loadable)."""
    import torch

    buf = io.BytesIO()
    torch.save([[p.step, p.batches, p.participated, p.blob] for p in history], buf)
    return buf.getvalue()


def unpack_history(data: bytes) -> list[Position]:
    import torch

    rows = torch.load(io.BytesIO(data), weights_only=True)
    return [Position(int(s), int(b), bool(part), bytes(blob)) for s, b, part, blob in rows]


_POS = struct.Struct("<qBq")  # batches, participated, timeline


def position_body(p: Position, timeline: int = -1) -> bytes:
    """A position as a journal record's body (its step is the record's): ``batches`` (i64),
    ``participated`` (u8), ``timeline`` (i64: the step the job's timeline restarted from when it was
    recorded, -1 when not known), then ``blob`` (docs/FORMAT.md, "torchft")."""
    return _POS.pack(int(p.batches), int(bool(p.participated)), int(timeline)) + bytes(p.blob)


def position_of(step: int, body: bytes) -> tuple[Position, int]:
    """Inverse of :func:`position_body`: ``(position, timeline)``; raises
    :class:`~ckptstore.errors.IntegrityError` when ``body`` is not one."""
    from ..errors import IntegrityError

    if len(body) < _POS.size or body[8] > 1:
        raise IntegrityError(f"a journal record of step {step} is not a loader position ({len(body)} bytes)")
    batches, part, timeline = _POS.unpack_from(body, 0)
    return Position(int(step), int(batches), bool(part), bytes(body[_POS.size :])), int(timeline)


def position_at(positions: Iterable[Position], step: int) -> Position | None:
    """The position of the greatest step ≤ ``step`` (never a newer one: its batches are not in the
    checkpoint of ``step``), or None."""
    best = None
    for p in positions:
        if p.step <= step and (best is None or p.step > best.step):
            best = p
    return best


def newest_positions(names: Iterable[str]) -> dict[int, int]:
    """``{group: N}``: the newest step of each group's positions versions among ``names``."""
    newest: dict[int, int] = {}
    for n in names:
        gv = parse_loader_version(n)
        if gv is not None:
            newest[gv[0]] = max(newest.get(gv[0], -1), gv[1])
    return newest


def lagging_groups(step: int, newest_position: dict[int, int], window: int) -> list[int]:
    """The groups active around main step ``step`` whose newest saved position is older than it
    (``step - window <= newest < step``): their position at ``step`` may have died with them."""
    return sorted(g for g, n in newest_position.items() if step - window <= n < step)


def absent_from_quorum(participants: int | None, at_step: dict[int, Position | None]) -> bool:
    """Whether the groups that saved no position at a main step were not in that step's quorum:
    ``participants`` is the number of groups the main version's writer counted in the quorum
    (its manifest's ``torchft.participants``; None: not recorded), ``at_step`` the position at that
    step of every group that saved one at or after it (:func:`position_at`). When as many of them
    *participated* at exactly that step as the quorum had participants, every participant is one of
    them: no other group took that step, so each other group's position there is its own newest
    (it took no step since it left). Never true without the writer's count."""
    if participants is None or participants < 1:
        return False
    took = sum(1 for p in at_step.values() if p is not None and p.participated)
    return took == participants


def choose_main(main_steps: Iterable[int], newest_position: dict[int, int], window: int,
                absent: Callable[[int, list[int]], str | None] | None = None) -> tuple[int | None, list[str]]:
    """The main step a cold start restores, and why newer ones were passed over.

    ``main_steps``: the committed main versions' steps; ``newest_position``: ``{group: N}`` the newest
    step each group saved its position at; ``window``: steps (the save interval). A step ``S`` is
    chosen when every group *active around it* (newest position ≥ ``S - window``) has a position at
    or after ``S`` — otherwise that group's position at ``S`` may have died with it, and restoring
    ``S`` would replay (or skip) its batches — unless ``absent(S, lagging)`` proves those groups
    were not in ``S``'s quorum (:func:`absent_from_quorum`; it returns why, or None): a group away
    at ``S`` continues from its own newest position. A group whose newest position is older than
    ``S - window`` was gone at ``S``: its position then is its newest one."""
    skipped: list[str] = []
    for s in sorted(set(main_steps), reverse=True):
        lagging = lagging_groups(s, newest_position, window)
        if not lagging or (absent is not None and absent(s, lagging)):
            return s, skipped
        skipped.append(f"{MAIN_PREFIX}{s}: the positions of group(s) {', '.join(map(str, lagging))} at that step "
                       f"were not saved (newest: " + ", ".join(f"g{g} step {newest_position[g]}" for g in lagging) + ")")
    return None, skipped


@dataclasses.dataclass(frozen=True)
class LoaderChoice:
    """What one rank's loader continues from: ``how`` is ``"own"`` (the position of the same group and
    rank at or before the restored step, saved by a group of the same number of ranks),
    ``"own-resharded"`` (the same group and rank, saved by a group of another number of ranks: the
    loader's state is applied as is, so it continues at that batch count of the shard the new shape
    gives it), ``"slowest"`` (no position of this group and rank is stored: the position of the rank
    that had delivered the fewest batches — of this group when it has any, else of any group — so no
    sample of the new shard is seen twice), ``"initial"`` (nothing stored: the loader as the program
    built it) or ``"peer"`` (joining a live job: torchft heals the model, the loader is the rank's own
    newest position). ``source``/``source_rank``: the group and rank whose position it is;
    ``step``/``batches``: that position's; ``rank``: this rank in its group."""

    group: int
    how: str
    source: int | None = None
    step: int | None = None
    batches: int | None = None
    reason: str = ""
    rank: int = 0
    source_rank: int | None = None


def loader_plan(group: int, num_groups: int | None, at_step: dict[int, Position | None]) -> tuple[
        LoaderChoice, Position | None, dict[int, int]]:
    """:func:`rank_loader_plan` for groups of one rank: ``at_step`` is ``{group: position}``."""
    return rank_loader_plan(group, 0, num_groups, 1, {(g, 0): p for g, p in at_step.items()}, {})


def rank_loader_plan(group: int, rank: int, num_groups: int | None, group_world: int,
                     at_step: dict[tuple[int, int], Position | None], stored_world: dict[int, int]) -> tuple[
        LoaderChoice, Position | None, dict]:
    """The loader policy when a job restarts with ``num_groups`` groups of ``group_world`` ranks
    (docs/torchft.md, "Cold start at another shape"). ``at_step``: ``{(group, rank): position}`` of
    every stored rank at the restored step; ``stored_world``: ``{group: ranks}`` of the group's stored
    positions (missing: ``group_world``).

    Rank ``rank`` of group ``group`` continues its own position (``"own"``; ``"own-resharded"`` when
    the group was saved by another number of ranks); a (group, rank) with no position takes the slowest
    stored rank's of its group, else of any group (``"slowest"``); nothing stored: ``"initial"``.
    Returns ``(choice, position or None, orphaned)``: ``orphaned`` is ``{group: batches}`` for
    stored groups with an index ≥ ``num_groups`` (the batches of all their ranks) and
    ``{"G.R": batches}`` for stored ranks ≥ ``group_world`` of groups that still run: their shards'
    remaining samples are seen by no rank until the job runs at that shape again."""
    orphaned: dict = {}
    for (g, r), p in sorted(at_step.items()):
        if p is None:
            continue
        if num_groups is not None and g >= num_groups:
            orphaned[g] = orphaned.get(g, 0) + p.batches
        elif r >= group_world:
            orphaned[f"{g}.{r}"] = p.batches
    own = at_step.get((group, rank))
    if own is not None:
        saved = stored_world.get(group, group_world)
        if saved == group_world:
            return (LoaderChoice(group, "own", group, own.step, own.batches, "its own position", rank, rank),
                    own, orphaned)
        return (LoaderChoice(group, "own-resharded", group, own.step, own.batches,
                             f"group {group} was saved by {saved} ranks and runs {group_world}: rank {rank} continues "
                             f"rank {rank}'s batch count ({own.batches}) on the shard the new shape gives it", rank, rank),
                own, orphaned)
    mine = [(p.batches, g, r, p) for (g, r), p in at_step.items() if p is not None and g == group]
    others = mine or [(p.batches, g, r, p) for (g, r), p in at_step.items() if p is not None]
    if others:
        batches, src, src_rank, p = min(others, key=lambda x: (x[0], x[1], x[2]))
        who = f"group {src}" if group_world == 1 and src_rank == 0 and not mine else f"group {src} rank {src_rank}"
        return (LoaderChoice(group, "slowest", src, p.step, batches,
                             f"no position of group {group} rank {rank} is stored: it starts from the slowest "
                             f"{'rank of its group' if mine else 'stored rank'}'s ({who}, {batches} batches)",
                             rank, src_rank), p, orphaned)
    return LoaderChoice(group, "initial", None, None, 0, "no position is stored", rank), None, orphaned


def live_step(members: dict[str, int], heartbeats: dict[str, float], fresh_s: float) -> int | None:
    """The step of the live job :func:`job_is_live` finds (its alive members' greatest), or None."""
    steps = [step for r, step in members.items() if step > 0 and heartbeats.get(r, float("inf")) < fresh_s]
    return max(steps) if steps else None


def job_is_live(members: dict[str, int], heartbeats: dict[str, float], fresh_s: float) -> tuple[bool, str]:
    """Does a live job exist that a starting group joins (torchft heals it from a peer), or is the whole
    job starting (ckptstore restores every group)? Live: a member of the lighthouse's previous quorum
    at a step > 0 whose heartbeat is fresher than ``fresh_s`` seconds."""
    live = sorted(r for r, step in members.items() if step > 0 and heartbeats.get(r, float("inf")) < fresh_s)
    if live:
        return True, f"replica(s) {', '.join(live)} of the previous quorum are alive at step {max(members[r] for r in live)}"
    if members:
        return False, "no member of the lighthouse's previous quorum is alive past step 0"
    return False, "the lighthouse has formed no quorum yet"


def manifest_user(quorum: int, group: int, replica_id: str | None, participants: int, ft_state: dict[str, Any]) -> dict:
    """The ``torchft`` entry of a main version's user metadata (docs/FORMAT.md, "torchft")."""
    return {"torchft": {"quorum_id": int(quorum), "group": int(group), "replica_id": replica_id,
                        "participants": int(participants), "step": int(ft_state["step"]),
                        "batches_committed": int(ft_state["batches_committed"])}}
