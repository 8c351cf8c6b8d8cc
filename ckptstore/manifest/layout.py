"""Key layout shared by every tier (docs/FORMAT.md, "Layout")::

    versions/<enc(version)>/manifest.json                 commit point (put-if-absent)
    versions/<enc(version)>/pinned                         retention pin (optional)
    versions/<enc(version)>/damaged.json                   scrub's damage mark (optional)
    versions/<enc(version)>/attempts/<attempt>/r00000.ckd  rank 0's shard object (frames)
    versions/<enc(version)>/attempts/<attempt>/metadata.ckd  pickled DCP Metadata (frames)
    versions/<enc(version)>/attempts/<attempt>/uploaded.r00000.json  rank 0 finished its upload (remote)
    versions/<enc(version)>/attempts/<attempt>/replicas.r00002.json  replicas rank 2 wrote into its root
    versions/<enc(version)>/.../.tmp-<random>              a local temporary file (garbage if left)
    probes/root.<token>                                    a root claim: which rank leads the root (local tier)
    leases/<attempt>.r00003.json                           what rank 3's save in flight references (see leases)
    leases/<attempt>.remote.json                           ... the remote commit of that save (remote tier)
    probes/put-if-absent.<nonce>                           conditional-write probe (remote; deleted at once)
    restores.jsonl                                         restore log of the jobs whose rank 0 used this root
    journals/<name>.log, journals/<name>.prev.log          a writer's journal (local tier; ckptstore.journal)

Every key and name of that layout is built or recognised here and nowhere else. The grammar of
its components (encoded version names, attempt ids, object names ``attempts/<attempt>/<file>``
and their ``ATTEMPTS`` directory) belongs to :mod:`ckptstore._names`, which this module builds on
and which imports nothing from here.
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets

from .._names import ATTEMPTS, decode_version, encode_version

VERSIONS = "versions"
MANIFEST = "manifest.json"
PINNED = "pinned"
DAMAGED = "damaged.json"
METADATA_OBJECT = "metadata.ckd"
#: prefix of the rank upload markers ``uploaded.rNNNNN.json`` (remote tier)
MARKER_PREFIX = "uploaded."
#: prefix of the replica records ``replicas.rNNNNN.json`` (local roots)
REPLICA_PREFIX = "replicas."
#: prefix of the local tier's temporary files (written, fsync'd, then renamed into place)
TMP_PREFIX = ".tmp-"
#: directory of the root probes (local tier): which ranks of a job see this root (docs/FORMAT.md, "Placement")
PROBES = "probes"
#: the restore log at the top of a local root (docs/FORMAT.md, "Restore log")
RESTORE_LOG = "restores.jsonl"
#: directory of the leases of saves in flight on earlier versions' objects (docs/FORMAT.md, "References")
LEASES = "leases"
#: directory of the journals of a local root (docs/FORMAT.md, "Journals"; ``ckptstore.journal``)
JOURNALS = "journals"


def version_dir(version: str) -> str:
    return f"{VERSIONS}/{encode_version(version)}"


def manifest_key(version: str) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def object_key(version: str, name: str) -> str:
    return f"{version_dir(version)}/{name}"


def pin_key(version: str) -> str:
    return f"{version_dir(version)}/{PINNED}"


def damaged_key(version: str) -> str:
    return f"{version_dir(version)}/{DAMAGED}"


def attempt_dir(attempt: str) -> str:
    """The directory of an attempt's objects, relative to its version directory."""
    return f"{ATTEMPTS}/{attempt}"


def shard_name(attempt: str, rank: int) -> str:
    return f"{attempt_dir(attempt)}/r{rank:05d}.ckd"


def metadata_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{METADATA_OBJECT}"


def marker_name(attempt: str, rank: int) -> str:
    """Rank ``rank``'s upload marker: it finished uploading its object of ``attempt`` (remote tier)."""
    return f"{attempt_dir(attempt)}/{MARKER_PREFIX}r{rank:05d}.json"


def replica_record_name(attempt: str, rank: int) -> str:
    """Rank ``rank``'s replica record: the replicas it wrote into its root (docs/FORMAT.md, "Replicas")."""
    return f"{attempt_dir(attempt)}/{REPLICA_PREFIX}r{rank:05d}.json"


def replica_record_rank(key: str) -> int | None:
    """The rank of the replica record ``key`` (any prefix), or None when it is not one."""
    return _rank_file(key, REPLICA_PREFIX)


def _rank_file(key: str, prefix: str) -> int | None:
    """NNNNN of a file named ``<prefix>rNNNNN.json`` (the last component of ``key``), else None."""
    base = key.rsplit("/", 1)[-1]
    if not (base.startswith(prefix + "r") and base.endswith(".json")):
        return None
    digits = base[len(prefix) + 1 : -len(".json")]
    return int(digits) if digits.isdigit() else None


#: the catalogue head at the top of a tier, and a local root's copy of the remote tier's head
#: (docs/FORMAT.md, "Catalogue chain")
CATALOGUE_HEAD = "catalogue-head.json"
REMOTE_HEAD_COPY = "catalogue-head.remote.json"

#: the writer record of an attempt's coordinator (docs/FORMAT.md, Delete rule 15)
WRITER_RECORD = "writer.json"


def writer_record_name(attempt: str) -> str:
    """The writer record of ``attempt``: who (host, boot, pid, start time) coordinates it (Delete rule 15)."""
    return f"{attempt_dir(attempt)}/{WRITER_RECORD}"


def is_writer_record(key: str) -> bool:
    """Whether ``key`` (any prefix) names an attempt's writer record."""
    return key.rsplit("/", 1)[-1] == WRITER_RECORD


def marker_prefix(attempt: str) -> str:
    """What every upload marker name of ``attempt`` starts with."""
    return f"{attempt_dir(attempt)}/{MARKER_PREFIX}"


def marker_rank(key: str) -> int | None:
    """The rank of the upload marker ``key`` (any prefix), or None when it is not a marker."""
    return _rank_file(key, MARKER_PREFIX)


def attempt_of_key(key: str) -> str | None:
    """The attempt of ``versions/<v>/attempts/<attempt>/<file>``, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 5 and parts[0] == VERSIONS and parts[2] == ATTEMPTS:
        return parts[3]
    return None


def is_temporary(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


def version_dir_of(key: str) -> str | None:
    """``versions/<enc>/`` for any key inside a version directory, else None."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != VERSIONS:
        return None
    return f"{parts[0]}/{parts[1]}/"


def new_attempt() -> str:
    """Unique per save attempt: UTC time (sortable) + 48 random bits + pid."""
    t = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{t}-{secrets.token_hex(6)}-{os.getpid() % 100000:05d}"


def version_of_key(key: str) -> str | None:
    """The version whose directory holds ``key`` (None if outside ``versions/``)."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != VERSIONS:
        return None
    try:
        return decode_version(parts[1])
    except Exception:
        return None


def lease_key(attempt: str, holder: str) -> str:
    """The lease of ``holder`` (``rNNNNN``: a rank; ``remote``: the remote commit) for the save
    ``attempt``: the earlier versions' objects that save references (docs/FORMAT.md, "References")."""
    return f"{LEASES}/{attempt}.{holder}.json"


def lease_prefix(attempt: str) -> str:
    """What every lease key of the save ``attempt`` starts with."""
    return f"{LEASES}/{attempt}."


#: name prefix of a root claim: ``probes/root.<token>`` names the rank that leads the root's group
#: for one save (token: its attempt) or load (docs/FORMAT.md, "Placement")
CLAIM_PREFIX = "root."


def claim_key(token: str) -> str:
    """The claim of a root for ``token`` (an attempt id, or a load's random token)."""
    if not token or not all(c.isalnum() or c in "-_" for c in token):
        raise ValueError(f"invalid claim token {token!r}")
    return f"{PROBES}/{CLAIM_PREFIX}{token}"


#: name prefix of the conditional-write probes of the remote tier (docs/FORMAT.md, "Conditional writes")
CONDITIONAL_PROBE = "put-if-absent."


def conditional_probe_key() -> str:
    """A fresh key for the probe that checks whether a remote endpoint enforces put-if-absent
    (docs/FORMAT.md, "Conditional writes")."""
    return f"{PROBES}/{CONDITIONAL_PROBE}{secrets.token_hex(8)}"


def if_match_probe_key() -> str:
    """A fresh key for the probe that checks whether an S3 endpoint enforces ``If-Match`` on PutObject."""
    return f"{PROBES}/if-match.{secrets.token_hex(8)}"
