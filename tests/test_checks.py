"""specdec_rt.checks: the one set of checking helpers (strict integers, finite numbers, bools)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_rt.checks import brief_repr, check_bool, check_int, check_number, is_int, is_number
from specdec_rt.errors import InferenceError, InvalidInputError, ModelLoadError


@pytest.mark.parametrize(
    "value,numpy,want",
    [
        (3, True, True),
        (0, False, True),
        (-(10**50), False, True),
        (np.int64(3), True, True),
        (np.uint8(3), True, True),
        (np.int64(3), False, False),
        (True, True, False),
        (False, False, False),
        (np.bool_(True), True, False),
        (3.0, True, False),
        (np.float64(3), True, False),
        ("3", True, False),
        (None, True, False),
        ([3], True, False),
    ],
)
def test_is_int_is_strict(value, numpy, want):
    assert is_int(value, numpy=numpy) is want
    assert is_int(-(10**5000))  # too long for str(), an int still


@pytest.mark.parametrize(
    "value,want",
    [
        (0, True),
        (-2.5, True),
        (np.float32(0.5), True),
        (np.int64(7), True),
        (10**300, True),
        (10**400, False),
        (float("nan"), False),
        (float("inf"), False),
        (-float("inf"), False),
        (True, False),
        (np.bool_(False), False),
        ("1", False),
        (None, False),
        (1j, False),
    ],
)
def test_is_number_means_finite_and_real(value, want):
    assert is_number(value) is want


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((0, "n", 1), {}, "n must be a positive integer, got 0"),
        ((True, "n", 1), {}, "n must be a positive integer, got True"),
        ((-1, "size", 0), {}, "size must be an integer >= 0, got -1"),
        ((21, "logprobs", 0, 20), {"optional": True}, "logprobs must be None or an integer in 0..20, got 21"),
        ((1, "max_length", 2), {"optional": True}, "max_length must be None or an integer >= 2, got 1"),
        ((5, "x", None, 4), {}, "x must be an integer <= 4, got 5"),
        ((1.5, "x"), {}, "x must be an integer, got 1.5"),
        ((np.int64(3), "x"), {"numpy": False}, "x must be an integer, got np.int64(3)"),
        (
            (9, "min_tokens", 0, 8),
            {"what": "an integer from 0 to max_new_tokens (8)"},
            "min_tokens must be an integer from 0 to max_new_tokens (8), got 9",
        ),
    ],
)
def test_check_int_names_the_argument_and_the_value(args, kwargs, message):
    if "np.int64" in message and not repr(np.int64(3)).startswith("np."):  # NumPy 1.x writes it as 3
        message = message.replace("np.int64(3)", "3")
    with pytest.raises(InvalidInputError) as info:
        check_int(*args, **kwargs)
    assert str(info.value) == message


def test_check_int_passes_good_values_through():
    assert check_int(5, "x", 0, 5) == 5 and check_int(None, "x", optional=True) is None
    assert check_int(np.int32(2), "x", 1) == 2 and check_int(-(10**5000), "x") == -(10**5000)
    with pytest.raises(InvalidInputError, match="x must be an integer, got None"):
        check_int(None, "x")


def test_the_error_class_is_the_callers():
    with pytest.raises(InferenceError, match="the drafter's max_length must be None or a positive integer"):
        check_int(0, "the drafter's max_length", 1, what="None or a positive integer", error=InferenceError)
    with pytest.raises(ModelLoadError, match="^flag must be True or False, got 1$"):
        check_bool(1, "flag", error=ModelLoadError)
    with pytest.raises(ModelLoadError, match="^rate must be a finite number >= 0"):
        check_number(-1, "rate", 0, error=ModelLoadError)


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((-1e-300, "temperature", 0.0), {}, "temperature must be a finite number >= 0, got -1e-300"),
        ((float("nan"), "temperature", 0.0), {}, "temperature must be a finite number >= 0, got nan"),
        ((3, "presence_penalty", -2.0, 2.0), {}, "presence_penalty must be a number from -2 to 2, got 3"),
        ((0, "top_p", 0.0, 1.0), {"lo_open": True, "optional": True}, "top_p must be in (0, 1] or None, got 0"),
        ((0, "x", 0.0), {"lo_open": True}, "x must be a finite number > 0, got 0"),
        (("1", "x"), {}, "x must be a finite number, got '1'"),
        ((True, "x"), {}, "x must be a finite number, got True"),
    ],
)
def test_check_number(args, kwargs, message):
    with pytest.raises(InvalidInputError) as info:
        check_number(*args, **kwargs)
    assert str(info.value) == message


def test_check_number_and_bool_pass_good_values_through():
    assert check_number(1.0, "top_p", 0.0, 1.0, lo_open=True) == 1.0 and check_number(None, "x", optional=True) is None
    assert check_number(10**300, "x") == 10**300 and check_number(np.float16(2), "x", 2, 2) == 2
    assert check_bool(True, "x") is True and check_bool(False, "x") is False
    for bad in (0, 1, "yes", None, np.bool_(True)):
        with pytest.raises(InvalidInputError, match="^x must be True or False"):
            check_bool(bad, "x")


def test_messages_stay_short_whatever_the_value():
    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert brief_repr(-(10**5000)).startswith("an int of") and "BadRepr" in brief_repr(BadRepr())
    for value in (-(10**5000), "x" * 10**7, [0] * 10**6, BadRepr()):
        with pytest.raises(InvalidInputError) as info:
            check_int(value, "n", 1)
        assert len(str(info.value)) < 200
