"""`python -m bench` (`make bench`): every benchmark in its quick form, JSON lines out."""

from bench import (
    attacks,
    engine,
    engine_vllm,
    failover,
    migration,
    pd,
    placement,
    protocols,
    router,
    router_overhead,
    routing,
    routing_vllm,
    stream_relay,
    weights,
)


def main() -> None:
    for fig in router_overhead.run(requests=100):
        print(fig.json_line(), flush=True)
    for fig in router.run():
        print(fig.json_line(), flush=True)
    for fig in stream_relay.run(seconds=2.0, rounds=2):
        print(fig.json_line(), flush=True)
    for fig in protocols.run(protocols.Settings(seconds=2.0, rounds=2, requests=20)):
        print(fig.json_line(), flush=True)
    for fig in routing.run():
        print(fig.json_line(), flush=True)
    for fig in failover.run():
        print(fig.json_line(), flush=True)
    for fig in migration.run():
        print(fig.json_line(), flush=True)
    for fig in pd.run(seconds=10.0):
        print(fig.json_line(), flush=True)
    for fig in engine.run():
        print(fig.json_line(), flush=True)
    # Against vLLM's CPU build (`make bench` installs it with `make vllm`).
    for fig in engine_vllm.run():
        print(fig.json_line(), flush=True)
    for fig in routing_vllm.run():
        print(fig.json_line(), flush=True)
    for fig in weights.run():
        print(fig.json_line(), flush=True)
    for fig in placement.run():
        print(fig.json_line(), flush=True)
    # The listener attack suite (issue 33), short form: ~80 s.
    for result in attacks.run():
        for fig in attacks.figures(result):
            print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
