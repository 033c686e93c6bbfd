"""The weight store and node cache: manifests, origins, verified parallel fetch, peers.

(A regular package: as a namespace package it was invisible to the import-linter
contracts that keep cloud SDKs and other planes out of the data plane.)
"""
