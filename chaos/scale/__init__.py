"""The fleet simulator (issue 34): thousands of simulated nodes and tens of routers against a
real control plane on Postgres, on one small machine, to measure how Meridian grows.

What is real and what is simulated, and why:

- The control plane is the real `meridian control-plane serve` process on a fresh Postgres
  database (`stack`): what it costs is what is measured, so nothing of it is stubbed.
- Nodes are the real node agent (`data_plane.agent.NodeAgent`), thousands per process
  (`nodes`), without an engine or a listener: they speak the node protocol exactly as a node
  does (register, heartbeat with load at the interval the control plane answers, drain,
  deregister; a death is an agent that stops without deregistering), their requests carried
  by one small keep-alive pool per process (`wire`). Their URLs point at loopback addresses
  nobody serves: nothing in a measurement calls a node.
- Routers are the real `geo_router.state.table.RoutingTableClient`, many per process (`routers`),
  so that 50 fit on two cores: what the control plane sends them (full tables today,
  deltas once the table stream has them) is what they install. One or two real
  `meridian router serve` processes beside them give a real router's memory and its view
  of the table version (its /metrics gauge).
- `measure` holds the in-process micro-measures that need no fleet: a table install
  (parse + LoadedTable.build), the per-request candidate scan, the KV index's memory and
  ingest rate on events in the real wire format.
- `run` composes one fleet-size point from these and returns its figures; `curve` fits their
  growth exponents, tables and plots them; `bench/scale.py` runs the points.

Because the simulator drives the real protocols through their public entry points, a change
to the control plane, the table stream or the router shows up in its figures with no change
here.
"""
