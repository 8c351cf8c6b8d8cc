"""Integrations of ckptstore into training frameworks (optional extras, never core dependencies).

* :mod:`ckptstore.integrations.torchtitan` — torchtitan's checkpointer saving through ckptstore
  (``pip install 'ckptstore[torchtitan]'``).
"""
