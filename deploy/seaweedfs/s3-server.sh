#!/bin/sh
# One S3 identity with full rights, keys from the environment (S3_ACCESS_KEY, S3_SECRET_KEY),
# and the bucket S3_BUCKET created at start. Every port but S3's (9000, as MinIO's) stays inside
# the container; telemetry is off, so nothing leaves the host.
set -eu
: "${S3_ACCESS_KEY:?set S3_ACCESS_KEY}" "${S3_SECRET_KEY:?set S3_SECRET_KEY}" "${S3_BUCKET:?set S3_BUCKET}"
umask 077
cat > /tmp/s3.json <<JSON
{"identities": [{"name": "admin",
  "credentials": [{"accessKey": "${S3_ACCESS_KEY}", "secretKey": "${S3_SECRET_KEY}"}],
  "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
JSON
exec weed mini -dir=/data -ip=127.0.0.1 -ip.bind=0.0.0.0 -s3.port=9000 -s3.config=/tmp/s3.json \
    -bucket="${S3_BUCKET}" -master.telemetry=false -webdav=false -admin.ui=false \
    -s3.port.iceberg=0 -s3.port.lance=0 "$@"
