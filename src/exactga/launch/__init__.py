"""How exactga meets the command line: ``tune ls``/``tune cp``/``tune run`` registration and
how a recipe ends on bad input. Imports nothing else of exactga."""
