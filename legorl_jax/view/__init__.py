"""`legorl view`: a local web app that reads a run directory while the run goes on."""
