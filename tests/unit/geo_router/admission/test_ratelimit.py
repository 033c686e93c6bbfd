"""Tenant rate limits: token buckets on requests and tokens, up-front estimates settled later."""

from __future__ import annotations

import json

import pytest
from ratelimit_kit import admitted, tenant
from router_harness import router_settings

from geo_router.admission.ratelimit import (
    InProcessRateLimiter,
    RedisRateLimiter,
    create_rate_limiter,
)
from geo_router.admission.tokens import estimate_tokens, usage_tokens
from geo_router.errors import RateLimited, error_response
from meridian.clock import ManualClock
from meridian.contracts import TenantEntry


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def limiter(clock: ManualClock) -> InProcessRateLimiter:
    return InProcessRateLimiter(clock=clock)


def refusal(limiter: InProcessRateLimiter, t: TenantEntry, tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        limiter.admit(t, tokens)
    return info.value


# --- buckets ---------------------------------------------------------------------------


def test_a_burst_of_one_minutes_worth_then_the_per_second_refill(limiter: InProcessRateLimiter,
                                                                  clock: ManualClock):
    t = tenant(rpm=60)
    assert admitted(limiter, t) == 60
    err = refusal(limiter, t)
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type_ == "requests"
    assert err.retry_after_s == 1 and err.headers["retry-after"] == "1"
    clock.advance(1.0)
    assert admitted(limiter, t) == 1
    clock.advance(3600)  # a long pause refills to the burst, never beyond it
    assert admitted(limiter, t) == 60


def test_the_token_bucket_refills_at_the_per_minute_rate(limiter: InProcessRateLimiter, clock: ManualClock):
    t = tenant(tpm=1200)  # 20 tokens per second
    assert admitted(limiter, t, 400) == 3
    err = refusal(limiter, t, 400)
    assert err.type_ == "tokens"
    assert err.retry_after_s == 20  # 400 tokens at 20/s
    assert "tokens per min (TPM): Limit 1200, Requested 400" in err.message
    clock.advance(19.9)
    refusal(limiter, t, 400)
    clock.advance(0.1)
    assert admitted(limiter, t, 400) == 1


def test_burst_is_a_setting(clock: ManualClock):
    limiter = InProcessRateLimiter(burst_s=6, clock=clock)
    t = tenant(rpm=600)  # 10/s, so a 6 s burst holds 60
    assert admitted(limiter, t) == 60
    clock.advance(0.5)
    assert admitted(limiter, t) == 5


def test_a_request_is_admitted_only_when_both_buckets_have_room(limiter: InProcessRateLimiter):
    t = tenant(rpm=10, tpm=1000)
    limiter.admit(t, 900)
    err = refusal(limiter, t, 200)
    assert err.type_ == "tokens"
    # The refused request took nothing: 9 requests of 100 tokens still fit.
    assert err.headers["x-ratelimit-remaining-requests"] == "9"
    assert admitted(limiter, t, 11) == 9
    assert refusal(limiter, t, 0).type_ == "requests"


def test_the_longest_wait_decides_retry_after(limiter: InProcessRateLimiter, clock: ManualClock):
    t = tenant(rpm=2, tpm=60)  # a request every 30 s, a token per second
    limiter.admit(t, 60)
    limiter.admit(t, 0)
    err = refusal(limiter, t, 10)
    assert err.retry_after_s == 30  # requests: 30 s; tokens: 10 s
    assert err.type_ == "requests"


def test_a_tenant_without_limits_is_never_limited(limiter: InProcessRateLimiter):
    t = tenant()
    for _ in range(1000):
        admission = limiter.admit(t, 1_000_000)
    assert admission.headers == {}
    only_tokens = limiter.admit(tenant(tpm=1000, name="other"), 10)
    assert "x-ratelimit-limit-requests" not in only_tokens.headers
    assert only_tokens.headers["x-ratelimit-remaining-tokens"] == "990"


def test_every_key_of_a_tenant_shares_its_limits(limiter: InProcessRateLimiter):
    key_a, key_b = tenant(rpm=4, key="a"), tenant(rpm=4, key="b")
    assert admitted(limiter, key_a, upto=2) == 2
    assert admitted(limiter, key_b) == 2
    assert admitted(limiter, tenant(rpm=4, name="someone-else", key="c")) == 4


def test_a_lowered_limit_applies_at_once(limiter: InProcessRateLimiter, clock: ManualClock):
    assert admitted(limiter, tenant(rpm=60), upto=5) == 5
    assert admitted(limiter, tenant(rpm=10)) == 10  # not the 55 left under the old limit
    clock.advance(6)
    assert admitted(limiter, tenant(rpm=10)) == 1


def test_admissions_carry_openai_rate_limit_headers(limiter: InProcessRateLimiter, clock: ManualClock):
    t = tenant(rpm=60, tpm=6000)
    limiter.admit(t, 100)
    headers = limiter.admit(t, 500).headers
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "58",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }
    limiter.settle(t, 600, 6000)
    clock.advance(0.5)
    assert limiter.admit(t, 0).headers["x-ratelimit-reset-tokens"] == "1m0s"


def test_the_refusal_is_openai_error_json_with_retry_after(limiter: InProcessRateLimiter):
    t = tenant(rpm=1, tpm=100)
    limiter.admit(t, 1)
    response = error_response(refusal(limiter, t, 1), request_id="req-1")
    assert response.status_code == 429
    assert json.loads(response.body)["error"] == {
        "message": "Rate limit reached for tenant `acme` on requests per min (RPM): Limit 1, Requested 1. "
                   "Please try again in 60s.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert response.headers["retry-after"] == "60"
    assert response.headers["retry-after-ms"] == "60000"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-remaining-tokens"] == "99"


def test_a_request_larger_than_the_whole_bucket_is_refused_for_good(limiter: InProcessRateLimiter,
                                                                    clock: ManualClock):
    t = tenant(rpm=100, tpm=1000)
    err = refusal(limiter, t, 1001)
    assert err.retry_after_s is None and "retry-after" not in err.headers
    assert err.headers["x-should-retry"] == "false"
    assert "never" in err.message and "max_tokens" in err.message
    # It took nothing, and exactly a full bucket is still admittable.
    assert limiter.admit(t, 1000).headers["x-ratelimit-remaining-requests"] == "99"
    clock.advance(3600)
    refusal(limiter, t, 1001)


# --- estimates and settling -----------------------------------------------------------------


def test_the_estimate_is_prompt_characters_over_four_plus_the_completion_budget():
    chat = {"messages": [{"role": "system", "content": "x" * 10},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 7},
                                                      {"type": "image_url", "image_url": {"url": "u"}}]}],
            "max_tokens": 50}
    assert estimate_tokens(chat) == 5 + 50  # ceil(17 / 4)
    assert estimate_tokens({**chat, "max_completion_tokens": 20}) == 5 + 20  # the newer name wins
    assert estimate_tokens({"messages": [{"role": "user", "content": "abcd"}]}) == 1 + 256
    assert estimate_tokens({"messages": [{"role": "user", "content": "abcd"}]},
                           default_completion_tokens=16) == 1 + 16
    assert estimate_tokens({"prompt": "z" * 9, "max_tokens": 10, "n": 3}) == 3 + 30
    assert estimate_tokens({"prompt": ["ab", "cd"], "max_tokens": 0}) == 1
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 1}) == 4  # token ids count as tokens
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 1}) == 4
    # Nonsense fields fall back to the default rather than failing here (the node rejects them).
    assert estimate_tokens({"prompt": "", "max_tokens": "lots", "n": True}) == 256
    assert estimate_tokens({"prompt": "", "max_tokens": -5}) == 256


def test_usage_tokens_reads_the_answers_usage():
    assert usage_tokens({"usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}) == 12
    assert usage_tokens({"usage": {"prompt_tokens": 7, "completion_tokens": 5}}) == 12
    assert usage_tokens({"usage": None}) is None
    assert usage_tokens({"choices": []}) is None


def test_settling_refunds_what_the_answer_did_not_use(limiter: InProcessRateLimiter):
    t = tenant(tpm=1000)
    limiter.admit(t, 600)
    refusal(limiter, t, 600)
    limiter.settle(t, estimated=600, actual=100)
    limiter.admit(t, 600)
    assert limiter.admit(t, 0).headers["x-ratelimit-remaining-tokens"] == "300"


def test_settling_charges_what_the_answer_used_beyond_the_estimate(limiter: InProcessRateLimiter,
                                                                    clock: ManualClock):
    t = tenant(tpm=600)  # 10 tokens per second
    limiter.admit(t, 100)
    limiter.settle(t, estimated=100, actual=1000)  # 400 tokens of debt
    err = refusal(limiter, t, 0)
    assert err.retry_after_s == 40
    clock.advance(40)
    assert limiter.admit(t, 0).headers["x-ratelimit-remaining-tokens"] == "0"
    # A refund never fills the bucket beyond its size.
    limiter.settle(t, estimated=10_000, actual=0)
    assert limiter.admit(t, 0).headers["x-ratelimit-remaining-tokens"] == "600"


def test_idle_tenants_are_forgotten(limiter: InProcessRateLimiter, clock: ManualClock):
    limiter.admit(tenant(rpm=5, name="once"), 0)
    clock.advance(3600)
    limiter.admit(tenant(rpm=5, name="now"), 0)
    assert set(limiter._tenants) == {"now"}


def test_settings_choose_the_limiter():
    assert isinstance(create_rate_limiter(router_settings()), InProcessRateLimiter)
    shared = create_rate_limiter(router_settings(redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(shared, RedisRateLimiter)
