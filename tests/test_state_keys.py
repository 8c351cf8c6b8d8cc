"""CheckpointManager saves module and optimizer keys in one spelling, whatever wraps the model.

``get_model_state_dict`` drops most wrapper components, but not ``torch.compile``'s ``_orig_mod``
inside ``checkpoint_wrapper`` (``model._orig_mod.0.weight`` where a plain, compiled or DDP model has
``model.0.weight``), so cross-loads failed with torch's one-spelling "Missing key". Real
``torch.compile`` (eager backend), real ``checkpoint_wrapper``, real DDP on a 1-rank gloo group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptstore.testing.dist import run_ranks

import keys_ranks


def _cross_load(tmp_path, names):
    results, stored = run_ranks(keys_ranks.cross_load, 1, str(tmp_path), names, timeout=400)[0]
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad
    assert len(results) == len(names) ** 2
    canonical = ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    assert stored == {w: canonical for w in names}


def test_wrapper_nestings_cross_load_bit_exact(tmp_path):
    _cross_load(tmp_path, ("plain", "compiled", "ddp", "ckpt(compiled)", "blocks"))


@pytest.mark.slow
def test_every_wrapper_nesting_cross_loads_bit_exact(tmp_path):
    _cross_load(tmp_path, tuple(keys_ranks.WRAPS))


def test_version_with_the_module_spelling_restores_and_mismatch_shows_both_spellings(tmp_path):
    out = run_ranks(keys_ranks.legacy_and_mismatch, 1, str(tmp_path), timeout=300)[0]
    assert out["plain"] and out["ckpt(compiled)"] and out["ddp(compiled)"]
    msg = " ".join(out["mismatch"])
    assert "StateDictKeysError" in msg, msg
    assert "'model.1.weight'" in msg and "'model._orig_mod.1.weight'" in msg, msg


def test_canonical_fqn_keeps_a_users_own_submodule_called_module():
    from ckptstore.manager import canonical_fqn

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)  # the user's name, not a wrapper's

    h = Holder()
    assert canonical_fqn(h, "module.weight") == "module.weight"
    wrapped = torch.compile(h, backend="eager")
    assert canonical_fqn(wrapped, "_orig_mod.module.weight") == "module.weight"
