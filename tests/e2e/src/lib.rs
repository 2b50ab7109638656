//! What wasmctrl's end-to-end tests share, compiled once for all of them: CRDs installed once, a
//! wasmctrl host running in-process for one test (scoped to its namespace and its own policies,
//! so tests running side by side never act on each other's objects), the objects and policies
//! the tests reconcile, and the Helm chart's helpers.
//!
//! The tests live in `tests/` and `benches/`; each takes what it needs with
//! `use wasmctrl_e2e::*;`.
#![warn(missing_docs)]

use std::time::Duration;

pub mod bench;
mod chart;
mod host;
mod http;
mod kinds;
mod kubelet;
mod objects;
mod policies;
mod process;
pub mod profile;
mod rbac;
mod sharded;
mod webhooks;

pub use chart::{
    CHART, apply_policy_rbac, apply_rbac_output, documents, dry_run_apply, helm,
    install_chart_rbac, install_chart_rbac_with, install_explain_reader, render,
};
pub use host::{
    HostBuilder, HostUnderTest, client_as, metric_sum, service_account_config,
    service_account_token,
};
pub use http::{
    DrippingServer, PluginServer, dripping_server, http_get, https_get, myapp_plugin_url,
    serve_plugins,
};
pub use kinds::{
    TEST_GROUP, myapp, myapp_policy_in, myapp_policy_spec, myapps, test_crd, widget, widget_test,
    widgets,
};
pub use kubelet::{HelmTest, Node, helm_test, run_chart_pod};
pub use objects::{
    COLLECT, api, apply, condition, condition_message, event_reasons, get, resource,
    wait_collected, wait_for_object, wait_for_object_within, wait_gone,
};
pub use policies::{
    apply_policy, candidate_decides_the_same, delete_namespace, file_source, namespaced_policies,
    place_namespace, policies, test_namespace,
};
pub use process::{
    SelfProcess, cosign, impersonating_kubeconfig, spawn_self, token_kubeconfig, wasmctrl_cli,
};
pub use rbac::{account_subject, bind_cluster_role, bind_role, may_read_metrics, service_account};
pub use sharded::ShardedHost;
pub use wasmctrl_testenv::crds::{crds_api, install_crd, install_repo_crds};
pub use webhooks::{Listener, hosting, listener, webhook_records};

/// Label that ties a test's policies to the host the test runs.
pub const TEST_LABEL: &str = "e2e.wasmctrl.dev/test";

/// How long anything that needs the host to act may take.
pub const ACT: Duration = Duration::from_secs(30);
