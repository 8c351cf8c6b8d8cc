"""One spelling of module and optimizer keys, whatever wraps the model (docs/howto/training-loop.md).

``torch.compile`` (``_orig_mod``), ``checkpoint_wrapper`` (``_checkpoint_wrapped_module``), DDP
(``module``) and FSDP1 (``_fsdp_wrapped_module``) add components to the names
``get_model_state_dict`` gives; :class:`~ckptstore.CheckpointManager` saves and loads under the
names without them (:func:`canonical_fqn`), and loads a version stored under a wrapper's spelling
by an earlier release through :class:`_SpellingLoadPlanner`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .errors import StateDictKeysError

# (module, class, attribute): a wrapper module and the attribute holding the module it wraps. Only
# classes of modules already imported are looked up (nothing here imports torch._dynamo).
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
)
# components only wrappers use: how a stored key of another spelling is recognised (textually)
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _wrapped_attr(m: Any) -> str | None:
    for modname, clsname, attr in _WRAPPERS:
        cls = getattr(sys.modules.get(modname), clsname, None)
        if cls is not None and isinstance(m, cls):
            return attr
    return None


def canonical_fqn(model: torch.nn.Module, fqn: str) -> str:
    """``fqn`` (a name ``get_model_state_dict(model)`` gives) without the components of wrapper
    modules: ``checkpoint_wrapper(torch.compile(m))``'s ``_orig_mod.0.weight`` → ``0.weight``. Walks
    the modules, so a user's own submodule called ``module`` keeps its name."""
    out = []
    m: Any = model
    for part in fqn.split("."):
        hop = False
        while isinstance(m, torch.nn.Module):
            attr = _wrapped_attr(m)
            if attr is None:
                break
            m = m._modules.get(attr)
            if part == attr:
                hop = True
                break
        if not hop:
            out.append(part)
            m = m._modules.get(part) if isinstance(m, torch.nn.Module) else None
    return ".".join(out)


def _textual(fqn: str) -> str:
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS)


class _Respelled(dict):
    """A module's or optimizer's state dict under canonical keys; ``back`` maps each canonical name to
    the module's own (what ``set_model_state_dict``/``set_optimizer_state_dict`` want)."""

    back: dict

    @classmethod
    def _of(cls, items, back: dict) -> "_Respelled":
        out = cls(items)
        out.back = back
        return out

    @classmethod
    def model(cls, model: torch.nn.Module, msd: dict) -> "_Respelled":
        names = {k: canonical_fqn(model, k) for k in msd}
        if len(set(names.values())) < len(names):  # two names would collapse into one: keep the module's own
            names = {k: k for k in msd}
        return cls._of({names[k]: v for k, v in msd.items()}, {c: k for k, c in names.items() if c != k})

    @classmethod
    def optimizer(cls, model: torch.nn.Module, osd: dict) -> "_Respelled":
        fqns = set(osd.get("state", {})) | {p for g in osd.get("param_groups", []) for p in g.get("params", [])}
        names = {k: canonical_fqn(model, k) for k in fqns if isinstance(k, str)}
        if len(set(names.values())) < len(names):
            names = {k: k for k in names}
        return cls._of(_respell_optim(osd, names), {c: k for k, c in names.items() if c != k})

    @staticmethod
    def back_of(sd: dict) -> dict:
        """``sd`` (after the load) under the module's own names."""
        back = getattr(sd, "back", None)
        if not back:
            return sd
        if "state" in sd or "param_groups" in sd:
            return _respell_optim(sd, back)
        return {back.get(k, k): v for k, v in sd.items()}


def _respell_optim(osd: dict, names: dict) -> dict:
    """An optimizer state dict (``get_optimizer_state_dict``: ``state`` keyed by parameter names,
    ``param_groups[i]["params"]`` lists of them) with the names mapped through ``names``."""
    out = dict(osd)
    if isinstance(osd.get("state"), dict):
        out["state"] = {names.get(k, k): v for k, v in osd["state"].items()}
    if isinstance(osd.get("param_groups"), list):
        out["param_groups"] = [
            {**g, "params": [names.get(p, p) for p in g["params"]]} if isinstance(g, dict) and isinstance(g.get("params"), list) else g
            for g in osd["param_groups"]
        ]
    return out


def _flat_aliases(sd: dict) -> dict[str, str]:
    """DCP's flattened key of every canonical module/optimizer entry in ``sd`` → the flattened key of the
    module's own spelling (what earlier releases stored)."""
    aliases: dict[str, str] = {}
    for k, v in sd.items():
        back = getattr(v, "back", None)
        if not back:
            continue
        if "state" in v and isinstance(v["state"], dict):
            for c, o in back.items():
                for sub in v["state"].get(c, {}) if isinstance(v["state"].get(c), dict) else ():
                    aliases[f"{k}.state.{c}.{sub}"] = f"{k}.state.{o}.{sub}"
        else:
            aliases.update({f"{k}.{c}": f"{k}.{o}" for c, o in back.items()})
    return aliases


class _SpellingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also loads a version whose module keys are spelled another way:
    saved by an earlier release that kept a wrapper's component (``model._orig_mod.0.weight``,
    checkpoint_wrapper around torch.compile) where this one saves ``model.0.weight``. A respelled key
    the version holds under neither spelling raises :class:`StateDictKeysError` showing both (other
    missing keys are DCP's to report)."""

    def __init__(self, sd: dict) -> None:
        super().__init__()
        self._aliases = _flat_aliases(sd)

    def create_local_plan(self):
        stored = self.metadata.state_dict_metadata
        by_text: dict[str, list[str]] | None = None
        missing = []
        for key in [k for k in self.state_dict if k not in stored]:
            alias = self._aliases.get(key)
            if alias is not None and alias in stored:
                found = [alias]
            else:
                if by_text is None:
                    by_text = {}
                    for s in stored:
                        if any(p in _WRAPPER_PARTS for p in s.split(".")):
                            by_text.setdefault(_textual(s), []).append(s)
                found = by_text.get(_textual(key), [])
            if len(found) == 1:
                self.state_dict[found[0]] = self.state_dict.pop(key)
                if key in self.mappings:
                    self.mappings[found[0]] = self.mappings.pop(key)
            elif alias is not None or found:
                missing.append((key, alias, found))
        if missing:
            shown = "; ".join(
                f"{k!r}" + (f" (the module's own spelling {a!r})" if a else "") + (f", stored as {f}" if f else "")
                for k, a, f in missing[:10]
            )
            raise StateDictKeysError(
                f"the checkpoint has no entry for {len(missing)} key(s) of the state: {shown}"
                + (" ..." if len(missing) > 10 else "")
                + ". Modules are saved under canonical keys (wrapper components such as _orig_mod, "
                "_checkpoint_wrapped_module or DDP's module dropped); was it saved from another model?"
            )
        return super().create_local_plan()
