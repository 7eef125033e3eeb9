"""pytest plugin: a private SeaweedFS S3 server (``weed mini``) for the test session.

Work in progress: the ``s3_server`` fixture is being written; importing this module is safe.
"""

from __future__ import annotations
