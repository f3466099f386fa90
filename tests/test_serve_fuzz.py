"""Fuzzing the API from its own OpenAPI schema (schemathesis strategies, run by hypothesis): a bounded
number of valid and of schema-violating requests per route against a real server on 127.0.0.1; no answer
may be a 5xx, and every 4xx is an OpenAI error object."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import ServerThread, shared_checkpoint  # noqa: E402

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

EXAMPLES = 15  # per route and mode: 9 x 15 = 135 requests
ANY_ROLE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


@pytest.fixture(scope="module")
def served():
    from nanoeuler.serve.app import create_app
    d, model, tok = shared_checkpoint()
    tok = tok.replace(chat_template=ANY_ROLE)   # every role the schema allows renders (Alpaca's has three)
    app = create_app(model, tok, "tiny", max_batch=8, max_queue=64, max_tokens_cap=32, max_n=2)
    with ServerThread(app) as srv:
        yield srv, schemathesis.openapi.from_dict(app.openapi())


BODIES = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"), ("/detokenize", "POST")]
ROUTES = ([(p, m, GenerationMode.POSITIVE) for p, m in BODIES] + [(p, m, GenerationMode.NEGATIVE) for p, m in BODIES]
          + [("/v1/models/{name}", "GET", GenerationMode.POSITIVE)])  # any string is a valid name: no negative case


@pytest.mark.parametrize("path,method,mode", ROUTES)
def test_no_request_gets_a_server_error(served, path, method, mode):
    srv, schema = served
    op = schema[path][method]
    seen = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # else nearly every valid body names an unknown model (404)
            if isinstance(case.body.get("n"), int):
                case.body["n"] = min(case.body["n"], 2)  # this server's limit, which the schema cannot state
            if case.body.get("prompt") in ("", []):
                case.body["prompt"] = "a"   # (a schema-valid empty prompt is refused: nothing to condition on)
            messages = [m for m in case.body.get("messages") or [] if isinstance(m, dict)]
            for m in messages:   # the rules across a message's fields, and the turn order, the schema cannot state
                if m.get("role") != "assistant":
                    m.pop("tool_calls", None)
                if m.get("content") is None and not m.get("tool_calls"):
                    m["content"] = "a"
            if messages and messages[-1].get("role") not in ("user", "tool"):
                messages[-1].update(role="user", content="a")
                messages[-1].pop("tool_calls", None)
        r = case.call(base_url=srv.url, timeout=30)
        seen.append(r.status_code)
        assert r.status_code < 500, (case.body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in r.text
    run()
    assert len(seen) >= EXAMPLES // 2
    if mode == GenerationMode.POSITIVE and "completions" in path:
        assert 200 in seen  # the fuzz reaches generation, not only the validators
