"""``ckptstore demo``: train a small transformer on 2 ranks, crash one mid-save, resume, and prove it.

Modules: :mod:`.model` (byte-level decoder-only transformer), :mod:`.data` (corpus and the
world-size-independent sampler), :mod:`.backend` (the ckptstore calls the demo makes),
:mod:`.train` (the per-rank worker that ``torchrun`` launches), :mod:`.supervisor` (launches and
watches the jobs), :mod:`.events` (reads the workers' event logs), :mod:`.verify`,
:mod:`.goodput`, :mod:`.plot`, :mod:`.seaweed` (``--seaweedfs``), :mod:`.orchestrate` (the whole
demo) and :mod:`.cli` (the ``ckptstore demo`` command). See ``docs/DEMO.md``.
"""
