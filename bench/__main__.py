"""`python -m bench` (`make bench`): every benchmark in its quick form, JSON lines out."""

from bench import engine, failover, placement, router, router_overhead, routing, weights


def main() -> None:
    for fig in router_overhead.run(requests=100):
        print(fig.json_line(), flush=True)
    for fig in router.run():
        print(fig.json_line(), flush=True)
    for fig in routing.run():
        print(fig.json_line(), flush=True)
    for fig in failover.run():
        print(fig.json_line(), flush=True)
    for fig in engine.run():
        print(fig.json_line(), flush=True)
    for fig in weights.run():
        print(fig.json_line(), flush=True)
    for fig in placement.run():
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
