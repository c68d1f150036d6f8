#!/usr/bin/env bash
# Writes a throwaway PKI for the TLS tests into DIR (created if missing),
# with the openssl command-line tool; valid for two days, EC P-256 keys
# (fast to make), unencrypted:
#
#   ca.pem ca.key                      test CA "kvq test CA"
#   server.pem server.key              signed by ca, SAN localhost + 127.0.0.1 + ::1
#   client.pem client.key              signed by ca, client auth
#   other_ca.pem other_ca.key          a second, unrelated CA
#   other_server.pem other_server.key  signed by other_ca, same SAN (rotation)
#   other_client.pem other_client.key  signed by other_ca (a client mTLS refuses)
#
#   usage: make_test_certs.sh DIR
set -euo pipefail
dir="${1:?usage: make_test_certs.sh DIR}"
mkdir -p "$dir"
cd "$dir"

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

make_ca() {  # name, common name
  new_key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

make_leaf() {  # name, ca, common name, extensions
  new_key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$3" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

server_ext='subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
extendedKeyUsage=serverAuth
basicConstraints=CA:FALSE'
client_ext='extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE'

make_ca ca "kvq test CA"
make_ca other_ca "kvq other test CA"
make_leaf server ca localhost "$server_ext"
make_leaf client ca "kvq test client" "$client_ext"
make_leaf other_server other_ca localhost "$server_ext"
make_leaf other_client other_ca "kvq other test client" "$client_ext"
rm -f ./*.srl
