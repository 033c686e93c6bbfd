"""Prefill/decode KV transfer for the torch engine (meridian.kv_transfer is the contract):
the payload a prefill node exports and a decode node imports (`payload`), and the
engine-side records of held and imported KV (`records`)."""
