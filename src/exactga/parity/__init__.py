"""The GA parity report: does a split of the global batch train what the full batch trains?

:mod:`exactga.parity.scoring` parses the splits and scores trained weights against the
full-batch run; :mod:`exactga.parity.report` writes the report. ``recipes/ga_parity.py`` trains.
"""
