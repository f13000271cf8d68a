"""Functions of a file other than the model's, with globals of their own, for the guard's tests
(``tests/test_module_attributes.py``, NOTE [a settings file's values])."""

SCALE = 1.0
SHIFT = 0.0


def shifted(h):
    return h + SHIFT


def scaled(h):
    return shifted(h) * SCALE
