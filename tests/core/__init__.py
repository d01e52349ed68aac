"""Tests of the protocol of one call, played against scripted answers: no store, no threads."""
