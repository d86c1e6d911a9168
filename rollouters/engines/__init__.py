"""Inference engines behind one :class:`~rollouters.engines.base.Engine` protocol."""
