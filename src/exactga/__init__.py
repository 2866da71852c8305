"""exactga: torchtune recipes whose gradient accumulation and data parallelism are exactly
full-batch training. See README.md and docs/."""

from exactga.launch.registry import register_config_resolvers

# Shipped configs name exactga's own files as ${exactga_file:...}; any import of exactga (every
# recipe's) makes that resolvable. See exactga.launch.registry.
register_config_resolvers()
