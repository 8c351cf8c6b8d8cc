"""Minimal stand-in for the ``expecttest`` package, used only when it is not installed (it is last on
the runner's PYTHONPATH). ``torch.testing._internal.common_utils`` needs ``expecttest.TestCase``;
PyTorch's DCP tests do not use inline expectations."""

import unittest


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 - upstream name
        self.assertEqual(str(actual).strip(), str(expect).strip())
