//! Every cache the host fills starts with a streamed list where the API server offers one.
//!
//! A watcher's first list is, by default, paginated `LIST` calls: the API server encodes each
//! page whole (500 objects) and the client holds a page at a time before the watch starts.
//! A streaming list (the watch-list of Kubernetes 1.27+, KEP-3157: a watch with
//! `sendInitialEvents=true`) sends the same objects as watch events from the API server's
//! watch cache, one by one, and ends them with a bookmark; the watch then goes on from there.
//! It costs the API server less memory and CPU on large kinds, and costs the host no page of
//! objects at once.
//!
//! An API server that does not offer it (the `WatchList` feature gate off, a version before
//! it, an aggregated API server of its own) refuses such a watch outright with `400` or
//! `422`. The watch then lists page by page for the rest of its life, as it would have
//! without the option: a refused request once per watch is the whole cost. (A kind that
//! cannot be watched at all, `405`, is no refusal: a paged list would fill a cache that never
//! learns of a change, so its cache stays unsynced and says so.)
//!
//! kube-runtime asks for a streaming list at `resourceVersion=0`: "any version", which an
//! API server may answer from a watch cache that lags the others' (with several API
//! servers behind a load balancer). The paged list it replaces is a consistent read, and a
//! host that reconciles on an older world than it saw before would write children of an old
//! spec. So [`consistent_initial_events`] takes that `resourceVersion` out of the request,
//! which makes it a consistent read too: the API server sends the initial events once its
//! cache has caught up with the moment the request came in.

use std::fmt::Debug;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use kube::Api;
use kube::runtime::watcher::{Config, Error, Event};
use serde::de::DeserializeOwned;

type Events<K> = BoxStream<'static, Result<Event<K>, Error>>;

/// How a watch of `S` lists: streaming (and able to fall back) or page by page.
enum Listing<S, K> {
    Streaming {
        events: Events<K>,
        source: S,
        config: Config,
    },
    Paged(Events<K>),
}

/// [`kube::runtime::watcher`], whose lists are streamed where the API server offers it and
/// paginated where it refuses (see the module).
pub(crate) fn watcher<K>(
    api: Api<K>,
    config: Config,
) -> impl Stream<Item = Result<Event<K>, Error>> + Send + 'static
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watch_with(api, config, |api: Api<K>, config| {
        kube::runtime::watcher(api, config).boxed()
    })
}

/// The listing strategy around `start`, which makes a watcher of `source` with a config.
fn watch_with<S, K>(
    source: S,
    config: Config,
    start: fn(S, Config) -> Events<K>,
) -> impl Stream<Item = Result<Event<K>, Error>> + Send + 'static
where
    S: Clone + Send + 'static,
    K: Send + 'static,
{
    let streaming = Listing::Streaming {
        events: start(source.clone(), config.clone().streaming_lists()),
        source,
        config,
    };
    futures::stream::unfold(streaming, move |listing| async move {
        match listing {
            Listing::Paged(mut events) => {
                let event = events.next().await?;
                Some((event, Listing::Paged(events)))
            }
            Listing::Streaming {
                mut events,
                source,
                config,
            } => {
                let event = events.next().await?;
                if let Some(refusal) = refused(&event) {
                    tracing::info!(
                        refusal,
                        "the API server refused a streaming list; this watch lists page by page"
                    );
                    let mut paged = start(source, config);
                    let event = paged.next().await?;
                    return Some((event, Listing::Paged(paged)));
                }
                Some((
                    event,
                    Listing::Streaming {
                        events,
                        source,
                        config,
                    },
                ))
            }
        }
    })
}

/// The API server's message, when `event` says it refused the streaming list itself (as
/// opposed to failing the watch for any other reason, which the watcher retries as ever).
fn refused<K>(event: &Result<Event<K>, Error>) -> Option<&str> {
    match event {
        Err(Error::WatchStartFailed(kube::Error::Api(status)))
            if matches!(status.code, 400 | 422) =>
        {
            Some(status.message.as_str())
        }
        _ => None,
    }
}

/// Make a streaming list's request a consistent read (see the module): a watch with
/// `sendInitialEvents=true` loses its `resourceVersion=0`. Any other request is left as it
/// is.
pub(crate) fn consistent_initial_events<B>(request: &mut http::Request<B>) {
    let Some(query) = request.uri().query() else {
        return;
    };
    let pairs: Vec<&str> = query.split('&').collect();
    if !pairs.contains(&"sendInitialEvents=true") || !pairs.contains(&"resourceVersion=0") {
        return;
    }
    let kept: Vec<&str> = pairs
        .into_iter()
        .filter(|pair| *pair != "resourceVersion=0")
        .collect();
    let path_and_query = format!("{}?{}", request.uri().path(), kept.join("&"));
    let mut parts = request.uri().clone().into_parts();
    match path_and_query.parse() {
        Ok(path_and_query) => parts.path_and_query = Some(path_and_query),
        Err(_) => return,
    }
    if let Ok(uri) = http::Uri::from_parts(parts) {
        *request.uri_mut() = uri;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;
    use kube::runtime::watcher::InitialListStrategy;

    fn failed(code: u16) -> Result<Event<u8>, Error> {
        let status = Status::failure("sendInitialEvents is forbidden", "Invalid").with_code(code);
        Err(Error::WatchStartFailed(kube::Error::Api(Box::new(status))))
    }

    /// A fake API server: a streaming list gets `streaming`'s answer, a paged one lists 7.
    fn server(streaming: u16) -> fn((), Config) -> Events<u8> {
        fn answer(code: u16, config: Config) -> Events<u8> {
            if config.initial_list_strategy == InitialListStrategy::StreamingList {
                futures::stream::iter([failed(code)]).boxed()
            } else {
                futures::stream::iter([
                    Ok(Event::Init),
                    Ok(Event::InitApply(7)),
                    Ok(Event::InitDone),
                ])
                .boxed()
            }
        }
        match streaming {
            422 => |(), config| answer(422, config),
            400 => |(), config| answer(400, config),
            _ => |(), config| answer(500, config),
        }
    }

    fn describe(events: Vec<Result<Event<u8>, Error>>) -> Vec<String> {
        events
            .into_iter()
            .map(|event| match event {
                Ok(Event::Init) => "init".to_owned(),
                Ok(Event::InitApply(n)) => format!("apply {n}"),
                Ok(Event::InitDone) => "done".to_owned(),
                Ok(other) => format!("{other:?}"),
                Err(error) => format!("error: {error}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn a_refused_streaming_list_is_listed_page_by_page() {
        for code in [400, 422] {
            let events = watch_with((), Config::default(), server(code))
                .collect::<Vec<_>>()
                .await;
            assert_eq!(describe(events), ["init", "apply 7", "done"], "{code}");
        }
    }

    #[test]
    fn a_streaming_list_is_asked_for_as_a_consistent_read() {
        let uri = |text: &str| {
            let mut request = http::Request::get(text).body(()).expect("a valid URI");
            consistent_initial_events(&mut request);
            request.uri().to_string()
        };
        assert_eq!(
            uri(
                "/api/v1/namespaces/ns/pods?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0"
            ),
            "/api/v1/namespaces/ns/pods?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
        );
        // A resumed watch, and a list, keep their versions.
        for kept in [
            "/api/v1/pods?&watch=true&allowWatchBookmarks=true&resourceVersion=0",
            "/api/v1/pods?&watch=true&allowWatchBookmarks=true&resourceVersion=123",
            "/api/v1/pods?&limit=500",
        ] {
            assert_eq!(uri(kept), kept);
        }
    }

    #[tokio::test]
    async fn any_other_failure_is_the_watcher_s_to_retry() {
        let events = watch_with((), Config::default(), server(500))
            .collect::<Vec<_>>()
            .await;
        let described = describe(events);
        assert_eq!(described.len(), 1);
        assert!(described[0].starts_with("error:"), "{described:?}");
    }
}
