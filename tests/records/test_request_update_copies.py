"""``RequestUpdate.with_tokens`` builds its copies field by field (positionally, for speed): it
must give exactly what ``attrs.evolve`` gives, for every field, so a field added to the record is not dropped."""

import attrs

from inference_server.records.requests import PromptTokenLogprob, RequestUpdate, TokenOutput

UPDATE = RequestUpdate(request_id=3, tokens=(TokenOutput(5, "a", -0.5),), finish_reason="stop", stop_reason="x",
                       error="e", prompt_tokens=11, completion_tokens=7, cached_prompt_tokens=4,
                       prompt_logprobs=(PromptTokenLogprob(2, None),))


def test_every_field_is_set_apart_from_its_default() -> None:
    defaults = RequestUpdate(request_id=0)
    assert all(getattr(UPDATE, f.name) != getattr(defaults, f.name) for f in attrs.fields(RequestUpdate))


def test_with_tokens_is_evolve() -> None:
    tokens = (TokenOutput(1, "b", -1.0), TokenOutput(2, "c", -2.0))
    assert UPDATE.with_tokens(tokens, None) == attrs.evolve(UPDATE, tokens=tokens, prompt_logprobs=None)
    assert UPDATE.with_tokens(tokens, None, 0) == attrs.evolve(UPDATE, tokens=tokens, prompt_logprobs=None,
                                                               cached_prompt_tokens=0)

