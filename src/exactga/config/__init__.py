"""Settings: the values each knob may take, the keys each recipe reads with their one default,
and the strict validation that turns a YAML config into them. Imports nothing else of exactga."""
