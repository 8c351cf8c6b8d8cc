"""Integrations of ckptstore into training frameworks (optional extras, never core dependencies).

* :mod:`ckptstore.integrations.torchtitan` — torchtitan's checkpointer saving through ckptstore
  (torchtitan 0.3.0: ``pip install -e '.[torchtitan]'`` in a clone of ckptstore).
* :mod:`ckptstore.integrations.torchft` — ckptstore as the durable tier under torchft's per-step
  fault tolerance (``pip install 'ckptstore[torchft]'``).
* :mod:`ckptstore.integrations.lightning` — PyTorch Lightning's ``CheckpointIO`` and
  ``ModelParallelStrategy`` saving, loading and removing through ckptstore
  (``pip install 'ckptstore[lightning]'``).
"""
