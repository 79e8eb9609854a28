"""Device profiles: one TOML file per device class."""
