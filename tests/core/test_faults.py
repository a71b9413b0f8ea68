"""FAULTS: the grammar (valid, invalid with a clear message naming the setting), seeded decisions, and the
synchronous wrappers (a KV allocator that acts as if the pool were full, a tokenizer that raises)."""

from __future__ import annotations

import pytest

from inference_server.config import SettingsError, load_settings
from inference_server.core.fault_wrappers import FaultyTokenizer, refusing_allocator
from inference_server.core.faults import FaultDecisions, FaultSpec, FaultSpecError, InjectedFault, parse_faults
from inference_server.core.kv_grants import Demand, StepDemand, allocate_step
from inference_server.core.kv_manager import KVManager


def test_the_documented_example_parses() -> None:
    spec = parse_faults("step_error=0.01,step_delay=0.2:0.05,alloc_refuse=0.1,tokenizer_error=0.02,seed=7")
    assert spec == FaultSpec(step_error=0.01, step_delay=0.2, step_delay_seconds=0.05, alloc_refuse=0.1,
                             tokenizer_error=0.02, seed=7)
    assert spec.enabled
    assert parse_faults(spec.describe()) == spec


@pytest.mark.parametrize("text", ["", " ", ",", "seed=3", "step_error=0", "step_delay=0.5:0"])
def test_empty_or_zero_specs_inject_nothing(text: str) -> None:
    assert not parse_faults(text).enabled
    assert parse_faults(text).describe() == ""


def test_spaces_around_items_are_allowed() -> None:
    assert parse_faults(" step_error = 1 , seed = 2 ") == FaultSpec(step_error=1.0, seed=2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step_eror=0.1", "unknown fault 'step_eror'"),
        ("step_error", "is not name=value"),
        ("step_error=", "is not name=value"),
        ("step_error=1.5", "not a probability in \\[0, 1\\]"),
        ("alloc_refuse=-0.1", "not a probability"),
        ("tokenizer_error=often", "'often' is not a number"),
        ("step_error=nan", "not a finite number"),
        ("step_delay=0.5", "needs a fraction and seconds"),
        ("step_delay=0.5:-1", "seconds must be >= 0"),
        ("step_delay=0.5:inf", "not a finite number"),
        ("seed=1.5", "is not an integer"),
        ("seed=-1", "must be >= 0"),
        ("step_error=0.1,step_error=0.2", "given twice"),
    ],
)
def test_invalid_specs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse_faults(text)


def test_an_invalid_faults_setting_stops_start_up_naming_the_setting() -> None:
    with pytest.raises(SettingsError, match=r"FAULTS='step_error=2' is invalid: step_error: '2' is not a probability"):
        load_settings(environ={"FAULTS": "step_error=2"}, dotenv_path=None)
    assert load_settings(environ={"FAULTS": "alloc_refuse=0.5"}, dotenv_path=None).faults == "alloc_refuse=0.5"


def _draws(spec: FaultSpec, kind: str, n: int) -> list[bool]:
    decisions = FaultDecisions(spec)
    return [decisions.fires(kind) for _ in range(n)]  # type: ignore[arg-type]


def test_decisions_are_deterministic_given_the_seed() -> None:
    spec = FaultSpec(step_error=0.3, alloc_refuse=0.3, seed=7)
    assert _draws(spec, "step_error", 200) == _draws(spec, "step_error", 200)
    assert _draws(spec, "step_error", 200) != _draws(FaultSpec(step_error=0.3, seed=8), "step_error", 200)


def test_each_kind_has_its_own_stream() -> None:
    """Drawing for one fault does not shift another's decisions (a fault's n-th step is the same whichever
    other faults are on)."""
    alone = _draws(FaultSpec(alloc_refuse=0.3, seed=1), "alloc_refuse", 100)
    mixed = FaultDecisions(FaultSpec(alloc_refuse=0.3, step_error=0.5, seed=1))
    interleaved = []
    for _ in range(100):
        mixed.fires("step_error")
        interleaved.append(mixed.fires("alloc_refuse"))
    assert interleaved == alone


def test_decisions_follow_the_probability() -> None:
    decisions = FaultDecisions(FaultSpec(step_error=0.1, seed=3))
    hits = sum(decisions.fires("step_error") for _ in range(10_000))
    assert 850 < hits < 1150 and decisions.counts["step_error"] == hits
    assert not any(_draws(FaultSpec(seed=3), "step_error", 1000))
    assert all(_draws(FaultSpec(step_error=1.0), "step_error", 1000))


# -- the allocator wrapper ---------------------------------------------------------------------------------

def _demand(*items: Demand, victims: tuple[int, ...] = (), releases=()) -> StepDemand:
    return StepDemand(releases=releases, items=items, victims=victims, token_budget=64, max_sequences=8)


def test_a_refused_step_starts_nothing_new_and_leaves_the_pool_as_it_was() -> None:
    kv = KVManager(block_size=4, num_full_blocks=16)
    refusing = refusing_allocator(allocate_step, FaultDecisions(FaultSpec(alloc_refuse=1.0)))
    grant = refusing(kv, _demand(Demand(1, new=True, num_tokens=5, tokens=tuple(range(5)))))
    assert grant.grants == () and grant.preempted == ()
    assert kv.num_sequences == 0 and kv.full_pool.num_referenced == 0
    kv.check_integrity()


def test_a_refused_step_lets_sequences_grow_only_within_their_blocks_or_by_preempting() -> None:
    kv = KVManager(block_size=4, num_full_blocks=16)
    allocate_step(kv, _demand(Demand(1, new=True, num_tokens=3, tokens=(1, 2, 3)),
                              Demand(2, new=True, num_tokens=4, tokens=(5, 6, 7, 8))))
    refusing = refusing_allocator(allocate_step, FaultDecisions(FaultSpec(alloc_refuse=1.0)))
    # 1 has room in its block for a fourth token; 2's block is full, so it needs a new one: the pool counts
    # as full, so 2 can only grow by preempting the lowest-priority victim (itself, here: 1 was granted).
    grant = refusing(kv, _demand(Demand(1, new=False, num_tokens=1), Demand(2, new=False, num_tokens=1),
                                 victims=(2, 1)))
    assert [g.request_id for g in grant.grants] == [1]
    assert grant.preempted == (2,)
    assert kv.num_sequences == 1
    kv.check_integrity()


def test_a_refused_step_can_use_blocks_freed_by_preempting_a_victim() -> None:
    kv = KVManager(block_size=4, num_full_blocks=16, enable_prefix_cache=False)
    allocate_step(kv, _demand(Demand(1, new=True, num_tokens=4, tokens=(1, 2, 3, 4)),
                              Demand(2, new=True, num_tokens=4, tokens=(5, 6, 7, 8))))
    refusing = refusing_allocator(allocate_step, FaultDecisions(FaultSpec(alloc_refuse=1.0)))
    grant = refusing(kv, _demand(Demand(1, new=False, num_tokens=1), victims=(2, 1)))
    assert grant.preempted == (2,) and [g.request_id for g in grant.grants] == [1]
    kv.check_integrity()


def test_releases_are_applied_on_a_refused_step() -> None:
    kv = KVManager(block_size=4, num_full_blocks=16)
    allocate_step(kv, _demand(Demand(1, new=True, num_tokens=4, tokens=(1, 2, 3, 4))))
    refusing = refusing_allocator(allocate_step, FaultDecisions(FaultSpec(alloc_refuse=1.0)))
    refusing(kv, _demand(releases=((1, (1, 2, 3, 4)),)))
    assert kv.num_sequences == 0 and kv.full_pool.num_referenced == 0
    kv.check_integrity()


def test_an_unrefused_step_is_the_plain_allocation() -> None:
    plain, wrapped = KVManager(block_size=4, num_full_blocks=16), KVManager(block_size=4, num_full_blocks=16)
    demand = _demand(Demand(1, new=True, num_tokens=5, tokens=tuple(range(5))))
    never = refusing_allocator(allocate_step, FaultDecisions(FaultSpec(alloc_refuse=0.0)))
    assert never(wrapped, demand) == allocate_step(plain, demand)


# -- the tokenizer wrapper ---------------------------------------------------------------------------------


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def test_the_tokenizer_wrapper_raises_for_the_chosen_requests_and_delegates_the_rest() -> None:
    spec = FaultSpec(tokenizer_error=0.5, seed=4)
    expected = _draws(spec, "tokenizer_error", 40)
    tokenizer = FaultyTokenizer(CharTokenizer(), FaultDecisions(spec))
    outcomes = []
    for i in range(40):
        try:
            assert tokenizer.encode(f"p{i}") == [ord("p"), *map(ord, str(i))]
            outcomes.append(False)
        except InjectedFault:
            outcomes.append(True)
    assert outcomes == expected and any(outcomes) and not all(outcomes)
    assert tokenizer.decode([104, 105]) == "hi"  # not a fault point
    always = FaultyTokenizer(CharTokenizer(), FaultDecisions(FaultSpec(tokenizer_error=1.0)))
    with pytest.raises(InjectedFault, match="tokenizer_error"):
        always.apply_chat_template([{"role": "user", "content": "x"}])


class TemplateTokenizer(CharTokenizer):
    def __init__(self) -> None:
        self.template_kwargs: dict[str, object] = {}

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, *,  # type: ignore[override]
                            continue_final_message: bool = False, **template_kwargs: object) -> list[int]:
        self.template_kwargs = template_kwargs
        return super().apply_chat_template(messages, add_generation_prompt,
                                           continue_final_message=continue_final_message)


def test_the_tokenizer_wrapper_passes_the_template_arguments_on() -> None:
    """Admission passes a chat request's ``tools`` and ``chat_template_kwargs`` to the template as keyword
    arguments; the wrapper used to accept none, so with ``tokenizer_error`` on every such request failed
    (400 "cannot apply the chat template: ... unexpected keyword argument 'tools'"), not just the chosen ones."""
    inner = TemplateTokenizer()
    tokenizer = FaultyTokenizer(inner, FaultDecisions(FaultSpec(tokenizer_error=0.5, seed=4)))
    tools = [{"type": "function", "function": {"name": "f"}}]
    served = 0
    for _ in range(10):
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools,
                                                enable_thinking=False)
        except InjectedFault:
            continue
        served += 1
        assert ids == [ord("x")] and inner.template_kwargs == {"tools": tools, "enable_thinking": False}
    assert served > 0
