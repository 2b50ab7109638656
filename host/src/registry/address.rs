//! Where a source points: whether an address is on this machine, where credentials may go
//! without TLS.

/// Whether a registry (`host[:port]`) is on this machine.
pub(super) fn registry_is_loopback(registry: &str) -> bool {
    let host = registry
        .rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(registry, |(host, _)| host)
        .trim_matches(['[', ']']);
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a URL's host is on this machine.
pub(super) fn is_loopback(host: &url::Host<&str>) -> bool {
    match host {
        url::Host::Domain(name) => *name == "localhost",
        url::Host::Ipv4(ip) => ip.is_loopback(),
        url::Host::Ipv6(ip) => ip.is_loopback(),
    }
}
