"""The engine: its composed configuration and the options that build it, its request and step
types, sampling parameters, and the engine core that starts and supervises its actors."""
