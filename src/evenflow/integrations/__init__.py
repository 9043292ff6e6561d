"""Adapters that put evenflow operators into serving engines. They hold no math."""
