"""Canonical forms (kiln/canonical.py): a digest made with the params' text given is the
same digest, byte for byte (fingerprints are stored: a retried request must still match);
and a submission serializes its params once for its fingerprint and its dedup key."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln import canonical, demo
from kiln.app import App
from kiln.config import Settings

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(body=st.dictionaries(st.text(), VALUES, min_size=1, max_size=6), data=st.data())
def test_a_digest_with_some_texts_given_is_the_same_digest(body: dict[str, Any], data: Any) -> None:
    keys = data.draw(st.lists(st.sampled_from(sorted(body)), unique=True))
    texts = {key: canonical.canonical_json(body[key]) for key in keys}
    assert canonical.digest(body, texts) == canonical.digest(body)


def test_fingerprints_and_dedup_keys_keep_their_values() -> None:
    body = {"kind": "k", "params": {"b": 1, "a": "é"}, "deadline_s": 86400, "timeouts": [1, 2, 3]}
    texts = {"params": canonical.canonical_json(body["params"])}
    assert canonical.request_fingerprints(body, texts=texts) == canonical.request_fingerprints(body)
    params = {"prompt": "a fox", "steps": 4}
    assert canonical.dedup_key("k", params, ["x"], canonical.canonical_json(params)) == (
        canonical.dedup_key("k", params, ["x"])
    )


def test_a_submission_serializes_its_params_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a checked submission with an Idempotency-Key and content dedup
    app = App(settings=settings)
    demo.register(app)
    submission = app.submission("image.generate", {"prompt": "a fox"}, idempotency_key="k1")
    # When its task row is made (fingerprints, dedup key), every canonical text counted
    made: list[Any] = []
    canonical_json = canonical.canonical_json

    def counted(value: Any) -> str:
        made.append(value)
        return canonical_json(value)

    monkeypatch.setattr(canonical, "canonical_json", counted)
    new = app.task_row(submission)
    # Then the params were serialized once, and no text held them again
    holding = [v for v in made if v == submission.params or (isinstance(v, dict) and "params" in v)]
    assert holding == [submission.params]
    assert new.dedup_key is not None and new.fingerprint
