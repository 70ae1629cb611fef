"""Tenants: the API key a request came with (or a configured header) partitions the prefix cache and
the suffix cache, so one client cannot learn from its `speculative` counters or from a prefix-cache
hit whether another client's output continued a text or another client sent a prompt.

The engine tests run a real engine behind the real app (in-process) on the tiny target with static
suffix drafting: greedy output, so a request that sees nothing of another's outputs gets exactly
the counters it gets on a fresh server. Prefix-cache hits are read from the block pool at
admission (deterministic), not from timing.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import InProcessServer
from server.config import ConfigError, load_config
from server.middleware import GuardMiddleware, request_tenant, tenant_digest

MODEL = "tiny"
PROMPT = list(range(100, 140))   # two full KV blocks of 16 tokens can be reused
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}


# ---- who the tenant is -----------------------------------------------------------------------------

async def _echo_tenant(scope, receive, send):
    body = json.dumps({"tenant": request_tenant.get()}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _tenants_of(requests: list[tuple[str, dict]], **options) -> list[tuple[int, str | None]]:
    """(status, tenant) of each (path, headers) request through GuardMiddleware."""
    app = GuardMiddleware(_echo_tenant, max_body_size=4096, **options)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            replies = [await http.post(path, headers=headers) for path, headers in requests]
        return [(r.status_code, r.json().get("tenant") if r.status_code == 200 else None) for r in replies]
    return asyncio.run(run())


def bearer(key: str, **headers) -> dict:
    return {"authorization": f"Bearer {key}", **headers}


def test_each_key_is_a_tenant_named_by_a_digest():
    replies = _tenants_of([("/v1/completions", bearer("sk-alice")), ("/v1/completions", bearer("sk-bob")),
                           ("/v1/completions", bearer("sk-alice")), ("/v1/completions", bearer("sk-eve")),
                           ("/v1/completions", {}), ("/health", {})], api_key="sk-alice, sk-bob")
    (s1, alice), (s2, bob), (s3, alice_again), (s4, _), (s5, _), (s6, probe) = replies
    assert (s1, s2, s3) == (200, 200, 200) and (s4, s5) == (401, 401) and s6 == 200
    assert alice == alice_again == tenant_digest(b"sk-alice", None) and bob != alice
    assert len(alice) == 64 and "alice" not in alice   # the engine sees a digest, never the key
    assert probe is None


def test_a_tenant_header_names_tenants_within_its_key():
    """Behind a gateway (its own key, or none) the header names the tenant; a client holding another
    key cannot join a tenant by sending its name."""
    header = "X-Tenant-Id"
    replies = _tenants_of([("/v1/completions", bearer("sk-gateway", **{header: "acme"})),
                           ("/v1/completions", bearer("sk-gateway", **{header: "acme"})),
                           ("/v1/completions", bearer("sk-gateway", **{header: "initech"})),
                           ("/v1/completions", bearer("sk-gateway")),
                           ("/v1/completions", bearer("sk-other", **{header: "acme"}))],
                          api_key="sk-gateway,sk-other", tenant_header=header)
    (_, acme), (_, acme_again), (_, initech), (_, gateway), (_, other_acme) = replies
    assert acme == acme_again and len({acme, initech, gateway, other_acme}) == 4
    assert gateway == tenant_digest(b"sk-gateway", None)   # no header: the key is the tenant
    no_keys = _tenants_of([("/v1/completions", {header: "acme"}), ("/v1/completions", {header: "acme"}),
                           ("/v1/completions", {})], api_key=None, tenant_header=header)
    assert no_keys[0] == no_keys[1] and no_keys[0][1] is not None and no_keys[2] == (200, None)


def test_without_keys_or_header_every_request_is_the_same_tenant():
    replies = _tenants_of([("/v1/completions", {}), ("/v1/completions", bearer("EMPTY"))], api_key=None)
    assert replies == [(200, None), (200, None)]


def test_several_keys_and_the_tenant_options_in_the_config(tiny_pair, tmp_path):
    target = str(tiny_pair[0])
    config = load_config(flags={"model": target, "api_key": "k1,k2", "tenant_header": "X-Tenant-Id"}, environ={})
    assert config.api_key == "k1,k2" and config.tenant_header == "X-Tenant-Id"
    assert config.engine.share_caches_across_tenants is False
    yaml_file = tmp_path / "keys.yaml"
    yaml_file.write_text(f"model: {target}\napi_key: [k1, k2]\nshare_caches_across_tenants: true\n")
    config = load_config(str(yaml_file), environ={})
    assert config.api_key == "k1,k2" and config.engine.share_caches_across_tenants is True
    config = load_config(flags={"model": target}, environ={"SPECSERVE_API_KEY": "k1, k2"})
    assert config.api_key == "k1, k2"
    for flags, field in (({"api_key": "k1,,k2"}, "api_key"), ({"api_key": "k1,"}, "api_key"),
                         ({"tenant_header": "X Tenant"}, "tenant_header")):
        with pytest.raises(ConfigError, match=field):
            load_config(flags={"model": target, **flags}, environ={})


# ---- what one tenant can learn of another through the caches ------------------------------------------

def serve(tiny_pair, share: bool = False, **options):
    """A real engine behind the app, its prefix-cache hits (blocks matched at each admission) recorded."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64,
                                 share_caches_across_tenants=share,
                                 speculative={"method": "suffix", "num_speculative_tokens": 6, "adaptive": False}))
    hits, match_prefix = [], engine.pool.match_prefix

    def recorded(token_ids, tenant=None):
        blocks = match_prefix(token_ids, tenant)
        hits.append(len(blocks))
        return blocks
    engine.pool.match_prefix = recorded
    return engine, InProcessServer(create_app(engine, load_tokenizer(str(target)), MODEL, **options)), hits


def complete(url: str, hits: list[int], headers: dict) -> tuple[dict, int]:
    """A completion, its speculative counters and text, and how many prompt blocks it found cached."""
    response = httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    return {"text": body["choices"][0]["text"], **body["speculative"]}, hits[-1]


def test_a_second_key_cannot_tell_what_the_first_key_asked_or_got(tiny_pair):
    engine, server, hits = serve(tiny_pair, api_key="sk-alice,sk-bob")
    with server:
        alice, alice_hit = complete(server.url, hits, bearer("sk-alice"))
        bob, bob_hit = complete(server.url, hits, bearer("sk-bob"))
        # Bob, asking what Alice asked, gets what a fresh server gives: the same text and counters, no cached block.
        assert bob == alice and bob_hit == alice_hit == 0
        # Alice's own next request draws on both of her caches: that is what Bob cannot see.
        again, again_hit = complete(server.url, hits, bearer("sk-alice"))
        assert again["text"] == alice["text"] and again_hit == 2
        assert again["accepted"] > alice["accepted"] and again["target_forwards"] < alice["target_forwards"] / 2
        # A third key is refused, and the server goes on serving the tenants it knows.
        eve = httpx.post(server.url + "/v1/completions", json=COMPLETION, headers=bearer("sk-eve"), timeout=60)
        assert eve.status_code == 401 and eve.json()["error"]["code"] == "invalid_api_key"
        assert complete(server.url, hits, bearer("sk-bob"))[0]["accepted"] > bob["accepted"]
    engine.pool.check_invariants()


def test_tenant_header_values_are_tenants_and_requests_without_it_share_as_before(tiny_pair):
    engine, server, hits = serve(tiny_pair, tenant_header="X-Tenant-Id")
    with server:
        acme, acme_hit = complete(server.url, hits, {"X-Tenant-Id": "acme"})
        initech, initech_hit = complete(server.url, hits, {"X-Tenant-Id": "initech"})
        assert initech == acme and initech_hit == acme_hit == 0
        anonymous, anonymous_hit = complete(server.url, hits, {})
        assert anonymous == acme and anonymous_hit == 0
        # Requests without the header are one tenant, the None one: they share as every request did before.
        shared, shared_hit = complete(server.url, hits, {})
        assert shared["accepted"] > anonymous["accepted"] and shared_hit == 2


def test_sharing_across_tenants_on_purpose(tiny_pair):
    engine, server, hits = serve(tiny_pair, share=True, api_key="sk-alice,sk-bob")
    with server:
        alice, alice_hit = complete(server.url, hits, bearer("sk-alice"))
        bob, bob_hit = complete(server.url, hits, bearer("sk-bob"))
        assert bob["text"] == alice["text"] and alice_hit == 0 and bob_hit == 2
        assert bob["accepted"] > alice["accepted"] and bob["target_forwards"] < alice["target_forwards"] / 2


def test_every_route_that_generates_carries_the_tenant(tiny_pair):
    """Chat completions, completions and responses each hand the engine the key's tenant (the
    context variable survives the routes' work on threads)."""
    engine, server, _ = serve(tiny_pair, api_key="sk-alice")
    tenants, add_request = [], engine.add_request

    def recorded(request_id, prompt, params):
        tenants.append(params.tenant)
        return add_request(request_id, prompt, params)
    engine.add_request = recorded
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2},
              "/v1/responses": {"input": "hi", "max_output_tokens": 2}}
    with server:
        for path, body in bodies.items():
            response = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=bearer("sk-alice"),
                                  timeout=60)
            assert response.status_code == 200, (path, response.text)
    assert tenants == [tenant_digest(b"sk-alice", None)] * len(bodies)
