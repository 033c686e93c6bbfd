from meridian.security import bearer_token, generate_api_key, hash_api_key, key_prefix


def test_keys_are_unique_and_hash_is_stable_hex():
    a, b = generate_api_key(), generate_api_key()
    assert a != b and a.startswith("mrd_") and len(a) > 40
    assert hash_api_key(a) == hash_api_key(a) != hash_api_key(b)
    assert len(hash_api_key(a)) == 64 and a not in hash_api_key(a)


def test_prefix_does_not_reveal_the_key():
    key = generate_api_key()
    assert key.startswith(key_prefix(key)) and len(key_prefix(key)) <= 10


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
