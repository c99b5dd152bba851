"""slimopt inside other training engines. Each subpackage imports its engine, so it is imported only where that
engine is installed: ``slimopt.integrations.torchtitan`` (``pip install "slimopt[torchtitan]"``)."""
