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

/// Addresses a webhook may not reach unless a superuser allows it: the server's own network.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            a.is_private()
                || a.is_loopback()
                || a.is_link_local() // 169.254/16, cloud metadata (169.254.169.254) among them
                || a.is_multicast()
                || a.is_broadcast()
                || a.is_unspecified()
                || a.is_documentation()
                || a.octets()[0] == 100 && (a.octets()[1] & 0xC0) == 64 // 100.64/10 shared CGNAT
                || a.octets()[0] == 198 && (a.octets()[1] & 0xFE) == 18 // 198.18/15 benchmarking
                || a.octets()[0] >= 240 // 240/4 reserved
                || a.octets()[0] == 0
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            let s = a.segments();
            // Addresses that carry an IPv4 address a gateway may reach: NAT64 (64:ff9b::/96) and
            // 6to4 (2002::/16). Judge the address inside.
            let embedded = |hi: u16, lo: u16| {
                IpAddr::V4(std::net::Ipv4Addr::new(
                    (hi >> 8) as u8,
                    hi as u8,
                    (lo >> 8) as u8,
                    lo as u8,
                ))
            };
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
                return is_internal(embedded(s[6], s[7]));
            }
            if s[0] == 0x2002 {
                return is_internal(embedded(s[1], s[2]));
            }
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local, fd00:ec2::254 (metadata) among them
                || (s[0] & 0xffc0) == 0xfe80 // link-local
        }
    }
}

pub fn check_address(ip: IpAddr, allow: Allow) -> Result<(), Invalid> {
    if is_internal(ip) && !allow.private_addresses {
        return Err(refuse(format!("the destination resolves to {ip}, an internal address"))
            .with_hint("private, loopback, link-local, multicast and metadata addresses need pg_outbox.http_allow_private = on (superuser only)"));
    }
    Ok(())
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
    /// 408, 429, 5xx, connect errors, timeouts: the endpoint is not taking anything now. Back off,
    /// never bisect or dead-letter on these alone.
    Transient {
        retry_after: Option<Duration>,
        reason: String,
    },
    /// Any other status (a 4xx, a redirect): the batch was refused; bisect as for a SQL error.
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
            "https://169.254.169.254/latest",
            "https://[::1]/",
            "https://[fd00:ec2::254]/",
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
