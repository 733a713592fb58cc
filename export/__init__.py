"""Offline export tooling (server side): programs for every runtime, the model zoo, subnetwork slicing."""
