"""Reports: tables and figures."""
