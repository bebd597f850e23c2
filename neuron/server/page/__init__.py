"""The page for people at ``/``: a chat playground and the cluster at a glance, as static files (``static/``)."""
