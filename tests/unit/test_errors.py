"""The error tree: one root, a code on every class, the API's statuses unchanged."""

from __future__ import annotations

import inspect

import pytest

from kiln import errors, states
from kiln.api.errors import status_of
from kiln.client import ConnectionFailed


def _error_classes() -> list[type[BaseException]]:
    found = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
    ]
    return [*found, states.IllegalTransition, ConnectionFailed]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_class_is_a_kiln_error_with_a_code(cls: type[BaseException]) -> None:
    assert issubclass(cls, errors.KilnError)
    assert isinstance(cls.code, str) and cls.code


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_the_module_docstring_draws_every_class_with_its_code(cls: type[BaseException]) -> None:
    assert issubclass(cls, errors.KilnError)
    doc = errors.__doc__ or ""
    assert f"{cls.__name__}`` ``{cls.code}``" in doc


def test_handler_errors_keep_their_codes_and_retry_flags() -> None:
    # Given the errors a handler raises
    retryable = errors.Retryable("upstream busy", retry_after_s=3)
    permanent = errors.Permanent("bad prompt")
    coded = errors.Permanent("no model", code="model_not_found")

    # Then they are kiln errors that keep their codes, flags and messages
    assert (retryable.code, retryable.retryable) == ("task_failed", True)
    assert retryable.retry_after_s == 3
    assert (permanent.code, permanent.retryable) == ("permanent_failure", False)
    assert (coded.code, coded.message, str(coded)) == ("model_not_found", "no model", "no model")
    assert errors.TaskError().message == "TaskError"


def test_an_illegal_transition_keeps_its_fields_and_message() -> None:
    with pytest.raises(errors.KilnError) as raised:
        states.check(states.Status.SUCCESS, states.Event.CLAIM)

    error = raised.value
    assert isinstance(error, states.IllegalTransition)
    assert (error.status, error.event, error.target) == ("SUCCESS", "claim", None)
    assert error.message == "event claim is not allowed from SUCCESS to None"
    assert error.code == "illegal_transition"


@pytest.mark.parametrize(
    "error",
    [
        errors.ConfigError("KILN_PORT='x': expected a port number", variable="KILN_PORT"),
        errors.Retryable("upstream busy"),
        errors.Permanent("bad prompt"),
        states.IllegalTransition(states.Status.SUCCESS, states.Event.CLAIM),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_new_to_the_tree_are_answered_500_by_the_api(error: errors.KilnError) -> None:
    assert status_of(error) == 500
