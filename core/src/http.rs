//! The pure parts of HTTP sinks: where a sink may send, how a batch is signed, the idempotency
//! key, and what a response means. The worker does the I/O; everything it decides is here.

use crate::{Invalid, InvalidKind};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::time::Duration;

/// What the destination rules allow (the superuser-only settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allow {
    /// `http://` URLs (otherwise HTTPS only).
    pub plain_http: bool,
    /// Private, loopback, link-local, multicast and cloud-metadata addresses.
    pub private_addresses: bool,
}

/// A parsed destination URL that passed the scheme and syntax rules (not yet the address rules:
/// those apply to what the host resolves to at delivery time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub url: url::Url,
}

fn refuse(message: String) -> Invalid {
    Invalid::new(InvalidKind::Parameter, message)
}

impl Destination {
    pub fn parse(text: &str, allow: Allow) -> Result<Destination, Invalid> {
        let url = url::Url::parse(text).map_err(|e| refuse(format!("invalid url: {e}")))?;
        match url.scheme() {
            "https" => {}
            "http" if allow.plain_http => {}
            "http" => {
                return Err(refuse("plain http:// is refused".into()).with_hint(
                    "use https://, or have a superuser set pg_outbox.http_allow_plain = on",
                ))
            }
            other => return Err(refuse(format!("unsupported url scheme \"{other}\""))),
        }
        // "https:///in" parses as host "in": the text itself must name a host after "//".
        let after_scheme = text.split_once("://").map_or("", |(_, rest)| rest);
        if url.host().is_none() || after_scheme.starts_with('/') || after_scheme.is_empty() {
            return Err(refuse("the url has no host".into()));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                refuse("credentials in the url are refused".into()).with_hint(
                    "put them in the sink's headers, which are kept out of status and logs",
                ),
            );
        }
        if url.fragment().is_some() {
            return Err(refuse("a url fragment is meaningless for a webhook".into()));
        }
        // A literal address is checked now as well as at delivery.
        if let Some(ip) = literal_ip(&url) {
            check_address(ip, allow)?;
        }
        Ok(Destination { url })
    }
}

fn literal_ip(url: &url::Url) -> Option<IpAddr> {
    match url.host()? {
        url::Host::Ipv4(a) => Some(IpAddr::V4(a)),
        url::Host::Ipv6(a) => Some(IpAddr::V6(a)),
        url::Host::Domain(_) => None,
    }
}

/// Where an address is, for the destination rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Globally reachable: any sink may send there.
    Global,
    /// The server's own networks: private (RFC 1918, IPv6 unique local), loopback and shared
    /// (CGNAT) addresses. Only with `pg_outbox.http_allow_private = on`.
    Private,
    /// Everything else the IANA special-purpose registries mark as not globally reachable:
    /// link-local (cloud metadata at 169.254.169.254 among them), multicast, reserved,
    /// documentation, benchmarking, protocol-assignment and deprecated transition ranges, and
    /// IPv6 forms that embed an IPv4 address no gateway should be asked to reach. Never allowed.
    Never,
}

fn v4_in(a: std::net::Ipv4Addr, net: [u8; 4], len: u32) -> bool {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    (u32::from(a) & mask) == (u32::from(std::net::Ipv4Addr::from(net)) & mask)
}

fn v6_in(a: std::net::Ipv6Addr, net: [u16; 8], len: u32) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len)
    };
    (u128::from(a) & mask) == (u128::from(std::net::Ipv6Addr::from(net)) & mask)
}

/// The class of an IPv4 address: the IANA IPv4 Special-Purpose Address Registry, entry by entry
/// (the more specific globally reachable entries first), plus multicast and broadcast.
fn reach_v4(a: std::net::Ipv4Addr) -> Reach {
    const GLOBAL: [([u8; 4], u32); 5] = [
        ([192, 0, 0, 9], 32),    // Port Control Protocol anycast
        ([192, 0, 0, 10], 32),   // Traversal Using Relays around NAT anycast
        ([192, 31, 196, 0], 24), // AS112-v4
        ([192, 52, 193, 0], 24), // AMT
        ([192, 175, 48, 0], 24), // Direct Delegation AS112 Service
    ];
    const PRIVATE: [([u8; 4], u32); 5] = [
        ([10, 0, 0, 0], 8),     // private-use
        ([100, 64, 0, 0], 10),  // shared address space (CGNAT)
        ([127, 0, 0, 0], 8),    // loopback
        ([172, 16, 0, 0], 12),  // private-use
        ([192, 168, 0, 0], 16), // private-use
    ];
    const NEVER: [([u8; 4], u32); 11] = [
        ([0, 0, 0, 0], 8),          // "this network"
        ([169, 254, 0, 0], 16),     // link-local, cloud metadata
        ([192, 0, 0, 0], 24),       // IETF protocol assignments (DS-Lite, NAT64 discovery, ...)
        ([192, 0, 2, 0], 24),       // TEST-NET-1
        ([192, 88, 99, 0], 24),     // deprecated 6to4 relay anycast
        ([198, 18, 0, 0], 15),      // benchmarking
        ([198, 51, 100, 0], 24),    // TEST-NET-2
        ([203, 0, 113, 0], 24),     // TEST-NET-3
        ([224, 0, 0, 0], 4),        // multicast
        ([240, 0, 0, 0], 4),        // reserved
        ([255, 255, 255, 255], 32), // limited broadcast
    ];
    // Cloud metadata services inside otherwise private ranges (Alibaba Cloud's sits in CGNAT space).
    if v4_in(a, [100, 100, 100, 200], 32) {
        return Reach::Never;
    }
    if GLOBAL.iter().any(|&(n, l)| v4_in(a, n, l)) {
        Reach::Global
    } else if PRIVATE.iter().any(|&(n, l)| v4_in(a, n, l)) {
        Reach::Private
    } else if NEVER.iter().any(|&(n, l)| v4_in(a, n, l)) {
        Reach::Never
    } else {
        Reach::Global
    }
}

/// The class of an IPv6 address: the IANA IPv6 Special-Purpose Address Registry, plus
/// multicast, link-local and the deprecated site-local range. An address that carries an IPv4
/// address for a translator (NAT64's well-known prefix, 6to4) is judged by the address inside,
/// and never counts as private: asking a translator to reach a private network is refused.
fn reach_v6(a: std::net::Ipv6Addr) -> Reach {
    let s = a.segments();
    let embedded =
        std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let strict = |r: Reach| {
        if r == Reach::Global {
            Reach::Global
        } else {
            Reach::Never
        }
    };
    if a.is_loopback() {
        return Reach::Private; // ::1
    }
    if let Some(v4) = a.to_ipv4_mapped() {
        return reach_v4(v4); // ::ffff:a.b.c.d is how a dual-stack socket spells a.b.c.d
    }
    if v6_in(a, [0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96) {
        return strict(reach_v4(embedded)); // NAT64 well-known prefix
    }
    if v6_in(a, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16) {
        let inner =
            std::net::Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8);
        return strict(reach_v4(inner)); // 6to4
    }
    const GLOBAL: [([u16; 8], u32); 8] = [
        ([0x2001, 0x1, 0, 0, 0, 0, 0, 0x1], 128), // Port Control Protocol anycast
        ([0x2001, 0x1, 0, 0, 0, 0, 0, 0x2], 128), // TURN anycast
        ([0x2001, 0x1, 0, 0, 0, 0, 0, 0x3], 128), // DNS-SD service registration protocol anycast
        ([0x2001, 0x3, 0, 0, 0, 0, 0, 0], 32),    // AMT
        ([0x2001, 0x4, 0x112, 0, 0, 0, 0, 0], 48), // AS112-v6
        ([0x2001, 0x20, 0, 0, 0, 0, 0, 0], 28),   // ORCHIDv2
        ([0x2001, 0x30, 0, 0, 0, 0, 0, 0], 28),   // drone remote ID entity tags (DETs)
        ([0x2620, 0x4f, 0x8000, 0, 0, 0, 0, 0], 48), // Direct Delegation AS112 Service
    ];
    const NEVER: [([u16; 8], u32); 12] = [
        ([0, 0, 0, 0, 0, 0, 0, 0], 96), // unspecified and IPv4-compatible (deprecated)
        ([0, 0, 0, 0, 0, 0xffff, 0, 0], 96), // (mapped: handled above)
        ([0, 0, 0, 0, 0xffff, 0, 0, 0], 96), // IPv4-translated (SIIT)
        ([0x64, 0xff9b, 0x1, 0, 0, 0, 0, 0], 48), // local-use IPv4/IPv6 translation
        ([0x100, 0, 0, 0, 0, 0, 0, 0], 64), // discard-only
        ([0x2001, 0, 0, 0, 0, 0, 0, 0], 23), // IETF protocol assignments, Teredo among them
        ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32), // documentation
        ([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20), // documentation
        ([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16), // segment routing (SRv6) SIDs
        ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), // link-local
        ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), // site-local (deprecated)
        ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), // multicast
    ];
    // AWS's IPv6 metadata service sits in unique-local space.
    if v6_in(a, [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254], 128) {
        return Reach::Never;
    }
    if GLOBAL.iter().any(|&(n, l)| v6_in(a, n, l)) {
        Reach::Global
    } else if v6_in(a, [0xfc00, 0, 0, 0, 0, 0, 0, 0], 7) {
        Reach::Private // unique local
    } else if NEVER.iter().any(|&(n, l)| v6_in(a, n, l))
        // Global unicast is 2000::/3; everything else is reserved by the IETF (or one of the
        // special ranges above), and new special-purpose entries keep appearing: refuse it.
        || !v6_in(a, [0x2000, 0, 0, 0, 0, 0, 0, 0], 3)
    {
        Reach::Never
    } else {
        Reach::Global
    }
}

/// Where `ip` is: see `Reach`.
pub fn reach(ip: IpAddr) -> Reach {
    match ip {
        IpAddr::V4(a) => reach_v4(a),
        IpAddr::V6(a) => reach_v6(a),
    }
}

/// Addresses a webhook may not reach unless a superuser allows it (and some not even then).
pub fn is_internal(ip: IpAddr) -> bool {
    reach(ip) != Reach::Global
}

pub fn check_address(ip: IpAddr, allow: Allow) -> Result<(), Invalid> {
    match reach(ip) {
        Reach::Global => Ok(()),
        Reach::Private if allow.private_addresses => Ok(()),
        Reach::Private => Err(refuse(format!("the destination resolves to {ip}, an internal address"))
            .with_hint("private, loopback and shared (CGNAT) addresses need pg_outbox.http_allow_private = on (superuser only)")),
        Reach::Never => Err(refuse(format!(
            "the destination resolves to {ip}, an address that is not globally reachable"
        ))
        .with_hint("link-local, metadata, multicast, reserved and special-purpose addresses are refused whatever the settings")),
    }
}

/// Whether `host` is on an allowlist of comma-separated names, each a host (`hooks.example.com`)
/// or a suffix pattern (`*.example.com`, which does not match `example.com` itself). An empty
/// list allows every host. Case-insensitive.
pub fn host_allowed(host: &str, allowlist: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let mut entries = allowlist
        .split(',')
        .map(|e| e.trim().to_ascii_lowercase())
        .filter(|e| !e.is_empty())
        .peekable();
    if entries.peek().is_none() {
        return true;
    }
    entries.any(|e| match e.strip_prefix("*.") {
        Some(suffix) => host.len() > suffix.len() + 1 && host.ends_with(&format!(".{suffix}")),
        None => host == e,
    })
}

/// Refuses a destination whose host is not on the allowlist.
pub fn check_host(url: &url::Url, allowlist: &str) -> Result<(), Invalid> {
    let host = url.host_str().unwrap_or_default();
    if host_allowed(host, allowlist) {
        Ok(())
    } else {
        Err(refuse(format!(
            "host \"{host}\" is not in pg_outbox.http_allowed_hosts"
        ))
        .with_hint("a superuser sets the hosts HTTP sinks may reach"))
    }
}

/// Headers the worker sets itself, so a sink's extra headers may not.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-type",
    "content-length",
    "transfer-encoding",
    "connection",
    "idempotency-key",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];

/// Accepts an extra header of an HTTP sink (an `Authorization`, say) or says why not.
pub fn check_header(name: &str, value: &str) -> Result<(), Invalid> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || name.len() > 128 || !name.chars().all(token) {
        return Err(refuse(format!(
            "invalid header name \"{}\"",
            name.escape_debug()
        )));
    }
    if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(refuse(format!(
            "header \"{name}\" is set by pg_outbox itself"
        )));
    }
    // The value is a credential more often than not: never echo it.
    if value.len() > 8192 || value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(refuse(format!("invalid value for header \"{name}\"")));
    }
    Ok(())
}

/// A Standard Webhooks signing secret: `whsec_` and base64 of at least 24 random bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    pub fn parse(text: &str) -> Result<Secret, Invalid> {
        let bad = || {
            refuse("invalid signing secret".into())
                .with_hint("a secret is 'whsec_' followed by base64 of 24 to 64 random bytes")
        };
        let b64 = text.strip_prefix("whsec_").ok_or_else(bad)?;
        let bytes = BASE64.decode(b64).map_err(|_| bad())?;
        if !(24..=64).contains(&bytes.len()) {
            return Err(bad());
        }
        Ok(Secret(bytes))
    }

    /// The `webhook-signature` header value for a message: `v1,<base64 HMAC-SHA256>` over
    /// `"{id}.{timestamp}.{body}"`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
    }
}

/// A key that is the same for every redelivery of the same batch content: the events' ids, in
/// order, hashed. Used as `Idempotency-Key` and `webhook-id`.
pub fn batch_key(sink: &str, event_ids: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(sink.as_bytes());
    for id in event_ids {
        h.update(b"\n");
        h.update(id.as_bytes());
    }
    let digest = h.finalize();
    format!(
        "msg_{}",
        digest
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

/// What an HTTP response (or its absence) means for the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx: delivered, move the cursor.
    Delivered,
    /// 408, 429, 5xx, connect errors, timeouts: the endpoint may not be taking anything now, or
    /// may fail on one event. The failure policy treats it as any failure (the neighbour test
    /// tells an outage from poison), waiting at least `retry_after` before the next request.
    Transient {
        retry_after: Option<Duration>,
        reason: String,
    },
    /// Any other status (a 4xx, a redirect): the batch was refused.
    Rejected { reason: String },
}

pub fn classify(status: u16, retry_after: Option<&str>) -> Outcome {
    match status {
        200..=299 => Outcome::Delivered,
        408 | 429 | 500..=599 => Outcome::Transient {
            retry_after: retry_after.and_then(parse_retry_after),
            reason: format!("HTTP {status}"),
        },
        300..=399 => Outcome::Rejected {
            reason: format!("HTTP {status}: redirects are not followed"),
        },
        _ => Outcome::Rejected {
            reason: format!("HTTP {status}"),
        },
    }
}

/// `Retry-After` as delta-seconds (HTTP dates are not honoured: clocks differ), capped at an hour.
pub fn parse_retry_after(text: &str) -> Option<Duration> {
    let secs: u64 = text.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations() {
        let strict = Allow::default();
        let lax = Allow {
            plain_http: true,
            private_addresses: true,
        };
        assert!(Destination::parse("https://hooks.example.com/in", strict).is_ok());
        assert!(Destination::parse("http://hooks.example.com/in", strict)
            .unwrap_err()
            .message
            .contains("plain http"));
        assert!(Destination::parse("http://hooks.example.com/in", lax).is_ok());
        for bad in [
            "ftp://x.example/",
            "not a url",
            "https://user:pw@x.example/",
            "https://x.example/#frag",
            "file:///etc/passwd",
            "https:///in",
            "https:/in",
            "https:in",
        ] {
            assert!(Destination::parse(bad, lax).is_err(), "{bad}");
        }
        for internal in [
            "https://127.0.0.1/",
            "https://10.1.2.3/",
            "https://[::1]/",
            "https://[fd12:3456::1]/",
            "https://192.168.0.1/",
            "https://[::ffff:10.0.0.1]/",
            "https://100.64.0.1/",
        ] {
            assert!(Destination::parse(internal, strict).is_err(), "{internal}");
            assert!(
                Destination::parse(
                    internal,
                    Allow {
                        plain_http: false,
                        private_addresses: true
                    }
                )
                .is_ok(),
                "{internal}"
            );
        }
        assert!(!is_internal("93.184.216.34".parse().unwrap()));
        for internal in [
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "198.18.0.1",
            "250.1.2.3",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_internal(internal.parse().unwrap()), "{internal}");
        }
        assert!(
            !is_internal("64:ff9b::5db8:d822".parse().unwrap()),
            "NAT64 of a public address"
        );
        assert!(!is_internal("2606:2800:220:1::1".parse().unwrap()));
    }

    /// One address from every entry of the IANA IPv4 and IPv6 special-purpose address registries
    /// (as of 2026), plus multicast, the deprecated ranges and the embedded-IPv4 forms an attacker
    /// tried (issue #10), each with the class it must have.
    #[test]
    fn every_special_purpose_registry_entry_has_its_class() {
        use Reach::*;
        let table: &[(&str, Reach)] = &[
            // IPv4 registry
            ("0.0.0.0", Never), // 0.0.0.0/8 this network, 0.0.0.0/32 this host
            ("0.1.2.3", Never),
            ("10.20.30.40", Private), // 10.0.0.0/8
            ("100.64.0.1", Private),  // 100.64.0.0/10 shared
            ("100.127.255.254", Private),
            ("100.100.100.200", Never), // a cloud metadata service inside it
            ("127.0.0.1", Private),     // 127.0.0.0/8
            ("127.255.0.1", Private),
            ("169.254.169.254", Never), // 169.254.0.0/16 link-local, metadata
            ("169.254.0.1", Never),
            ("172.16.0.1", Private), // 172.16.0.0/12
            ("172.31.255.255", Private),
            ("192.0.0.1", Never),   // 192.0.0.0/24 IETF protocol assignments
            ("192.0.0.7", Never),   // 192.0.0.0/29 DS-Lite
            ("192.0.0.8", Never),   // 192.0.0.8/32 IPv4 dummy address
            ("192.0.0.9", Global),  // 192.0.0.9/32 PCP anycast
            ("192.0.0.10", Global), // 192.0.0.10/32 TURN anycast
            ("192.0.0.170", Never), // 192.0.0.170/32 NAT64/DNS64 discovery
            ("192.0.0.171", Never),
            ("192.0.2.1", Never),     // 192.0.2.0/24 TEST-NET-1
            ("192.31.196.1", Global), // 192.31.196.0/24 AS112-v4
            ("192.52.193.1", Global), // 192.52.193.0/24 AMT
            ("192.88.99.1", Never),   // 192.88.99.0/24 deprecated 6to4 relay anycast
            ("192.168.1.1", Private), // 192.168.0.0/16
            ("192.175.48.1", Global), // 192.175.48.0/24 Direct Delegation AS112
            ("198.18.0.1", Never),    // 198.18.0.0/15 benchmarking
            ("198.19.255.255", Never),
            ("198.51.100.1", Never),    // 198.51.100.0/24 TEST-NET-2
            ("203.0.113.1", Never),     // 203.0.113.0/24 TEST-NET-3
            ("240.0.0.1", Never),       // 240.0.0.0/4 reserved
            ("255.255.255.255", Never), // limited broadcast
            ("224.0.0.1", Never),       // multicast
            ("239.255.255.250", Never),
            ("8.8.8.8", Global),
            ("93.184.216.34", Global),
            ("100.63.255.255", Global), // just outside shared space
            ("172.32.0.1", Global),     // just outside 172.16/12
            ("192.0.3.1", Global),
            // IPv6 registry
            ("::1", Private),       // loopback
            ("::", Never),          // unspecified
            ("::127.0.0.1", Never), // IPv4-compatible (deprecated)
            ("::169.254.169.254", Never),
            ("::10.0.0.1", Never),
            ("::8.8.8.8", Never),
            ("::ffff:127.0.0.1", Private), // IPv4-mapped: judged as the IPv4 address
            ("::ffff:169.254.169.254", Never),
            ("::ffff:8.8.8.8", Global),
            ("::ffff:0:127.0.0.1", Never), // IPv4-translated (SIIT)
            ("::ffff:0:8.8.8.8", Never),
            ("64:ff9b::8.8.8.8", Global), // 64:ff9b::/96 NAT64 of a global address
            ("64:ff9b::127.0.0.1", Never), // ... of an internal one
            ("64:ff9b::10.0.0.1", Never),
            ("64:ff9b::169.254.169.254", Never),
            ("64:ff9b:1::a9fe:a9fe", Never), // 64:ff9b:1::/48 local-use translation
            ("64:ff9b:1::808:808", Never),
            ("100::1", Never),  // 100::/64 discard-only
            ("2001::1", Never), // 2001::/23 IETF protocol assignments; 2001::/32 Teredo
            ("2001:0:4136:e378:8000:63bf:80ff:fffe", Never), // Teredo embedding 127.0.0.1
            ("2001:1::1", Global), // PCP anycast
            ("2001:1::2", Global), // TURN anycast
            ("2001:1::3", Global), // DNS-SD SRP anycast
            ("2001:2::1", Never), // 2001:2::/48 benchmarking
            ("2001:3::1", Global), // 2001:3::/32 AMT
            ("2001:4:112::1", Global), // 2001:4:112::/48 AS112-v6
            ("2001:10::1", Never), // 2001:10::/28 ORCHID (deprecated)
            ("2001:20::1", Global), // 2001:20::/28 ORCHIDv2
            ("2001:30::1", Global), // 2001:30::/28 drone remote ID entity tags
            ("2001:db8::1", Never), // 2001:db8::/32 documentation
            ("3fff::1", Never), // 3fff::/20 documentation
            ("2002:7f00:1::", Never), // 6to4 of 127.0.0.1
            ("2002:a9fe:a9fe::", Never), // 6to4 of 169.254.169.254
            ("2002:0808:0808::", Global), // 6to4 of 8.8.8.8
            ("2620:4f:8000::1", Global), // Direct Delegation AS112
            ("5f00::1", Never), // 5f00::/16 SRv6 SIDs
            ("fc00::1", Private), // fc00::/7 unique local
            ("fd12:3456::1", Private),
            ("fd00:ec2::254", Never), // a cloud metadata service inside it
            ("fe80::1", Never),       // fe80::/10 link-local
            ("febf::1", Never),
            ("fec0::1", Never), // fec0::/10 site-local (deprecated)
            ("ff02::1", Never), // multicast
            ("2606:2800:220:1::1", Global),
            ("2a00:1450:4001::1", Global),
            ("3ffe:ffff::1", Global), // still inside 2000::/3
            ("4000::1", Never),       // IETF reserved, outside global unicast
            ("1::1", Never),
            ("e000::1", Never),
        ];
        let open = Allow {
            plain_http: false,
            private_addresses: true,
        };
        for &(text, want) in table {
            let ip: IpAddr = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(reach(ip), want, "{text}");
            assert_eq!(
                check_address(ip, Allow::default()).is_ok(),
                want == Global,
                "{text}"
            );
            assert_eq!(
                check_address(ip, open).is_ok(),
                want != Never,
                "{text} with private allowed"
            );
            let host = match ip {
                IpAddr::V4(_) => text.to_string(),
                IpAddr::V6(_) => format!("[{text}]"),
            };
            let url = format!("https://{host}/hook");
            assert_eq!(
                Destination::parse(&url, open).is_ok(),
                want != Never,
                "{url}"
            );
        }
    }

    #[test]
    fn signatures_verify_with_the_standard_webhooks_reference_library() {
        let text = format!("whsec_{}", BASE64.encode([7u8; 32]));
        let secret = Secret::parse(&text).unwrap();
        let body = br#"[{"specversion":"1.0","id":"x"}]"#;
        let (id, ts) = ("msg_abc", time_now());
        let mut headers = http::HeaderMap::new();
        headers.insert("webhook-id", id.parse().unwrap());
        headers.insert("webhook-timestamp", ts.to_string().parse().unwrap());
        headers.insert(
            "webhook-signature",
            secret.sign(id, ts, body).parse().unwrap(),
        );
        let verifier = standardwebhooks::Webhook::new(&text).unwrap();
        verifier.verify(body, &headers).unwrap();
        // A changed body does not verify.
        assert!(verifier.verify(b"[]", &headers).is_err());
        assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
        for bad in [
            "",
            "whsec_",
            "whsec_!!!",
            "sk_abc",
            &format!("whsec_{}", BASE64.encode([1u8; 8])),
        ] {
            assert!(Secret::parse(bad).is_err(), "{bad}");
        }
    }

    fn time_now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    #[test]
    fn batch_keys_are_stable_and_distinct() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let a = batch_key("s", &ids(&["1", "2"]));
        assert_eq!(a, batch_key("s", &ids(&["1", "2"])));
        assert_ne!(a, batch_key("s", &ids(&["1"])));
        assert_ne!(a, batch_key("t", &ids(&["1", "2"])));
        assert_ne!(
            batch_key("s", &ids(&["12"])),
            batch_key("s", &ids(&["1", "2"]))
        );
        assert!(a.starts_with("msg_") && a.len() == 36);
    }

    #[test]
    fn allowlists() {
        assert!(host_allowed("anything.example", ""));
        assert!(host_allowed("anything.example", " , "));
        let list = "hooks.example.com, *.corp.example";
        assert!(host_allowed("hooks.example.com", list));
        assert!(host_allowed("HOOKS.example.com.", list));
        assert!(host_allowed("a.b.corp.example", list));
        assert!(
            !host_allowed("corp.example", list),
            "a suffix pattern needs a subdomain"
        );
        assert!(!host_allowed("evilcorp.example", list));
        assert!(!host_allowed("hooks.example.com.evil.net", list));
        assert!(!host_allowed("127.0.0.1", list));
    }

    #[test]
    fn headers() {
        check_header("Authorization", "Bearer abc").unwrap();
        check_header("X-Team", "billing").unwrap();
        for (n, v) in [
            ("", "x"),
            ("Bad Name", "x"),
            ("X", "a\r\nInjected: 1"),
            ("Webhook-Signature", "x"),
            ("content-type", "x"),
        ] {
            let e = check_header(n, v).unwrap_err();
            assert!(!e.message.contains("Injected"), "values are never echoed");
        }
    }

    #[test]
    fn outcomes() {
        assert_eq!(classify(200, None), Outcome::Delivered);
        assert_eq!(classify(204, None), Outcome::Delivered);
        assert!(matches!(
            classify(500, None),
            Outcome::Transient {
                retry_after: None,
                ..
            }
        ));
        assert!(
            matches!(classify(429, Some("7")), Outcome::Transient { retry_after: Some(d), .. } if d == Duration::from_secs(7))
        );
        assert!(matches!(
            classify(429, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            Outcome::Transient {
                retry_after: None,
                ..
            }
        ));
        assert!(matches!(classify(408, None), Outcome::Transient { .. }));
        assert!(matches!(classify(422, None), Outcome::Rejected { .. }));
        assert!(
            matches!(classify(301, None), Outcome::Rejected { reason } if reason.contains("redirect"))
        );
        assert_eq!(parse_retry_after("999999"), Some(Duration::from_secs(3600)));
    }
}
