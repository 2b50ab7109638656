//! Asking the API server for one shard's objects: Kubernetes' server-side sharded list and
//! watch (KEP-5866, the `ShardedListAndWatch` feature gate), whose `shardSelector` narrows a
//! list or a watch to the objects whose uid hashes into a range, by the hash
//! [`super::shard_of`] puts parents in shards with.
//!
//! kube-rs's list and watch parameters have no field for it, so a shard's watch goes through
//! a client of its own that adds the parameter to every list and watch it sends
//! ([`shard_client`]): the watcher sends it on each page and each resumed watch, as the
//! API server wants (a continue token does not carry it).
//!
//! An API server without the gate ignores the parameter and answers with the whole
//! collection; [`narrows_by_shard`] asks it once, on a list of a built-in kind, whose answer
//! then says which shard it covers (`metadata.shardInfo`).

/// The `shardSelector` of `shard` of `count`: the parents whose uid hashes into its range.
pub fn shard_selector(shard: u32, count: u32) -> String {
    let (start, end) = super::shard_range(shard, count);
    format!("shardRange(object.metadata.uid, '0x{start:016x}', '0x{end:016x}')")
}

/// `client`, narrowed to `shard` of `count`: a client (in `client`'s default namespace)
/// whose lists and watches ask for that shard's objects only; any other request goes as it
/// is.
pub fn shard_client(client: kube::Client, shard: u32, count: u32) -> kube::Client {
    let namespace = client.default_namespace().to_owned();
    let parameter = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("shardSelector", &shard_selector(shard, count))
        .finish();
    let service = tower::service_fn(move |mut request: http::Request<kube::client::Body>| {
        if request.method() == http::Method::GET {
            add_parameter(&mut request, &parameter);
        }
        let client = client.clone();
        async move { client.send(request).await }
    });
    kube::Client::new(service, namespace)
}

/// Add `parameter` (`name=value`, encoded) to `request`'s query.
fn add_parameter<B>(request: &mut http::Request<B>, parameter: &str) {
    let uri = request.uri();
    let path_and_query = match uri.query() {
        Some(query) if !query.is_empty() => format!("{}?{query}&{parameter}", uri.path()),
        _ => format!("{}?{parameter}", uri.path()),
    };
    let mut parts = uri.clone().into_parts();
    match path_and_query.parse() {
        Ok(path_and_query) => parts.path_and_query = Some(path_and_query),
        Err(_) => return,
    }
    if let Ok(uri) = http::Uri::from_parts(parts) {
        *request.uri_mut() = uri;
    }
}

/// Whether the API server narrows lists and watches by shard: a list of one shard of
/// Namespaces (any replica may list them: the host's own permissions include them), whose
/// answer tells the shard it covers only where the selector was taken.
pub async fn narrows_by_shard(client: &kube::Client) -> Result<bool, kube::Error> {
    let selecting = shard_client(client.clone(), 0, 2);
    let request = http::Request::get("/api/v1/namespaces?limit=1")
        .body(Vec::new())
        .map_err(kube::Error::HttpError)?;
    let list: serde_json::Value = selecting.request(request).await?;
    Ok(list
        .pointer("/metadata/shardInfo")
        .is_some_and(|info| !info.is_null()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_s_selector_names_its_range_as_the_api_server_reads_it() {
        assert_eq!(
            shard_selector(0, 2),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
        );
        assert_eq!(
            shard_selector(1, 2),
            "shardRange(object.metadata.uid, '0x8000000000000000', '0x10000000000000000')"
        );
    }

    #[test]
    fn the_selector_is_added_to_the_query() {
        let uri = |text: &str| {
            let mut request = http::Request::get(text).body(()).expect("a valid URI");
            add_parameter(&mut request, "shardSelector=x%27");
            request.uri().to_string()
        };
        assert_eq!(
            uri("/apis/a/v1/things?&watch=true&resourceVersion=5"),
            "/apis/a/v1/things?&watch=true&resourceVersion=5&shardSelector=x%27"
        );
        assert_eq!(
            uri("/apis/a/v1/things"),
            "/apis/a/v1/things?shardSelector=x%27"
        );
    }
}
