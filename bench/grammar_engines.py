"""xgrammar against llguidance on the embedded model's tokenizer (Gemma 3, 262,144 ids): grammar compile time
(first and cached), the time to fill one step's token bitmask for 64 rows, and which JSON-schema features each
enforces. The measurement behind the grammar engine choice in docs/architecture.md ("Constrained decoding").

Both packages must be installed to run it (the project keeps only the winner as a dependency):
``uv pip install xgrammar llguidance && uv run python bench/grammar_engines.py``.

A feature counts as enforced when the grammar compiles, a valid instance is accepted to the end and an invalid
one is refused before its end (token by token, as decoding feeds them).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from inference_server.models.loading.embedded import embedded_gguf_path
from inference_server.models.tokenizer import Tokenizer

ROWS = 64
MASK_STEPS = 20

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {  # what a pydantic model with a nested model, an enum, an optional and a list gives
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                        "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                       "required": ["sku", "qty"], "additionalProperties": False},
              "Status": {"enum": ["new", "paid", "shipped"], "type": "string"}},
    "type": "object",
    "properties": {"id": {"type": "integer"}, "status": {"$ref": "#/$defs/Status"},
                   "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
                   "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 5}},
    "required": ["id", "status", "note", "items"], "additionalProperties": False,
}
TREE = {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
    "type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["v", "kids"], "additionalProperties": False}},
    "$ref": "#/$defs/Node"}
SCHEMAS = {"person": PERSON, "order": ORDER, "tree": TREE}
INSTANCES = {
    "person": '{"name": "Ada", "age": 36}',
    "order": '{"id": 7, "status": "paid", "note": null, "items": [{"sku": "ABC-1234", "qty": 2}]}',
    "tree": '{"v": 1, "kids": [{"v": 2, "kids": []}]}',
}

# feature -> (schema, valid instance, invalid instance)
FEATURES: dict[str, tuple[dict[str, Any], str, str]] = {
    "enum": ({"enum": ["a", "b"]}, '"a"', '"c"'),
    "const": ({"const": 5}, "5", "6"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', "null"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
              '{"a": 1, "b": "x"}', '{"a": 1}'),
    "$ref recursive": (TREE, INSTANCES["tree"], '{"v": 1, "kids": [{"v": "x"}]}'),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}[0-9]$"}, '"ab1"', '"abc"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"abc"', '"abcd"'),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 7}, "5", "8"),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, "0.5", "-1"),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "15", "7"),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2]",
                          "[1, 2, 3]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    '[1, "a"]', '["a", 1]'),
    "additionalProperties: false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"x": 1}',
                                     '{"x": "y"}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, '{"n_a": 1}', '{"m": 1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["b"]}, '{"b": 1}', '{"a": 1}'),
    "minProperties": ({"type": "object", "minProperties": 2}, '{"a": 1, "b": 2}', '{"a": 1}'),
    "format: date": ({"type": "string", "format": "date"}, '"2026-12-03"', '"yesterday"'),
    "format: email": ({"type": "string", "format": "email"}, '"a@b.io"', '"nope"'),
    "type list": ({"type": ["integer", "null"]}, "null", '"x"'),
    "not": ({"not": {"type": "integer"}}, '"x"', "3"),
    "if/then": ({"if": {"properties": {"k": {"const": "n"}}}, "then": {"properties": {"v": {"type": "integer"}}}},
                '{"k": "n", "v": 1}', '{"k": "n", "v": "x"}'),
}

TOOL_LARK = ('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
             'call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": '
             '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], '
             '"additionalProperties": false}}, "required": ["name", "arguments"], "additionalProperties": false}\n')


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - started) * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.source_file))
        self.info, self.tokenizer_ms = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tokenizer.backend.get_vocab_size(), stop_token_ids=sorted(tokenizer.eos_token_ids)))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=8)
        self.vocab = tokenizer.backend.get_vocab_size()
        self.tokenizer = tokenizer

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def feed(self, matcher: Any, text: str) -> bool:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids)

    def complete(self, matcher: Any) -> bool:
        return matcher.is_completed() if hasattr(matcher, "is_completed") else matcher.accept_token(1)

    def fill_all(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def bitmask(self) -> torch.Tensor:
        self.batch = self.xgr.BatchGrammarMatcher()
        return self.xgr.allocate_token_bitmask(ROWS, self.vocab)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance

        self.llg = llguidance
        text = tokenizer.source_file.read_text()  # type: ignore[union-attr]
        self.info, self.tokenizer_ms = timed(lambda: llguidance.LLTokenizer(
            text, n_vocab=tokenizer.backend.get_vocab_size(), eos_token=sorted(tokenizer.eos_token_ids)))
        self.vocab = tokenizer.backend.get_vocab_size()
        self.tokenizer = tokenizer
        self.cache: dict[str, Any] = {}

    def compile(self, schema: dict[str, Any]) -> Any:
        key = json.dumps(schema, sort_keys=True)
        if key not in self.cache:  # llguidance keeps no cache of its own: a matcher per grammar is the cost
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            matcher = self.llg.LLMatcher(self.info, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            self.cache[key] = matcher
        return self.cache[key]

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def feed(self, matcher: Any, text: str) -> bool:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(i) for i in ids)

    def complete(self, matcher: Any) -> bool:
        return matcher.is_accepting()

    def fill_all(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                     bitmask)

    def bitmask(self) -> torch.Tensor:
        import llguidance.torch

        self.executor = self.llg.LLExecutor()
        return llguidance.torch.allocate_token_bitmask(ROWS, self.vocab)


def measure(engine: Any) -> dict[str, Any]:
    report: dict[str, Any] = {"tokenizer_ms": round(engine.tokenizer_ms, 1)}
    for name, schema in SCHEMAS.items():
        _, first = timed(lambda schema=schema: engine.compile(schema))
        compiled, cached = timed(lambda schema=schema: engine.compile(schema))
        bitmask = engine.bitmask()
        _, mask_ms = timed(lambda c=compiled, b=bitmask: engine.fill_all([engine.matcher(c)], b))
        report[f"compile {name} first/cached/first-mask ms"] = (round(first, 2), round(cached, 3), round(mask_ms, 2))
    # 64 rows of the order schema, each advanced to a different point of a valid instance.
    compiled = engine.compile(ORDER)
    ids = engine.tokenizer.encode(INSTANCES["order"], add_special_tokens=False)
    matchers = []
    for row in range(ROWS):
        m = engine.matcher(compiled)
        for token in ids[: row % (len(ids) - 1)]:
            assert (m.accept_token(token) if engine.name == "xgrammar" else m.consume_token(token))
        matchers.append(m)
    bitmask = engine.bitmask()
    times = []
    for _ in range(MASK_STEPS):
        _, ms = timed(lambda: engine.fill_all(matchers, bitmask))
        times.append(ms)
    report["mask 64 rows median/max ms"] = (round(statistics.median(times), 3), round(max(times), 3))
    enforced, missing = [], []
    for feature, (schema, good, bad) in FEATURES.items():
        try:
            compiled = engine.compile(schema)
            ok_good = engine.feed(m := engine.matcher(compiled), good) and engine.complete(m)
            bad_m = engine.matcher(compiled)
            ok_bad = not (engine.feed(bad_m, bad) and engine.complete(bad_m))
            (enforced if ok_good and ok_bad else missing).append(
                feature if ok_good and ok_bad else f"{feature} (valid ok: {ok_good}, invalid refused: {ok_bad})")
        except Exception as error:  # an engine that refuses the schema outright
            missing.append(f"{feature} (refused: {str(error).splitlines()[0][:80]})")
    report["enforced"] = f"{len(enforced)}/{len(FEATURES)}"
    report["not enforced"] = missing
    return report


def main() -> None:
    tokenizer = Tokenizer.from_gguf(embedded_gguf_path())
    for engine_cls in (XGrammar, LLGuidance):
        engine = engine_cls(tokenizer)
        print(engine.name, json.dumps(measure(engine)))
    import llguidance

    lark = llguidance.LLMatcher.grammar_from_lark(TOOL_LARK)
    info = LLGuidance(tokenizer).info
    tool, ms = timed(lambda: llguidance.LLMatcher(info, lark, log_level=0))
    print(f"llguidance lark tool-call grammar: {ms:.1f} ms, error: {tool.get_error()!r}")


if __name__ == "__main__":
    main()
