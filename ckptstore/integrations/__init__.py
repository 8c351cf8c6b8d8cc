"""Integrations of ckptstore into training frameworks (optional extras, never core dependencies).

* :mod:`ckptstore.integrations.torchtitan` — torchtitan's checkpointer saving through ckptstore
  (torchtitan 0.3.0: ``pip install -e '.[torchtitan]'`` in a clone of ckptstore).
"""
