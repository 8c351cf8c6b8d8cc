"""``ckptstore demo``: train a small transformer on 2 ranks, crash one mid-save, resume, and prove it.

Modules: :mod:`.model` (byte-level decoder-only transformer), :mod:`.data` (corpus and the
world-size-independent sampler), :mod:`.backend` (the DCP storage calls the demo makes),
:mod:`.train` (the per-rank worker that ``torchrun`` launches), :mod:`.supervisor` (runs the
jobs), :mod:`.verify`, :mod:`.goodput`, :mod:`.plot`, :mod:`.cli` (the ``ckptstore demo`` command).
"""
