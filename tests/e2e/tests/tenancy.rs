//! Tenancy: each policy acts as the ServiceAccount it names, and can do exactly what RBAC
//! grants that account — no more, whatever the host itself may do.
//!
//! The hosts here run with a token of a ServiceAccount of their own whose RBAC holds only
//! what the host needs for itself (ReconcilePolicies, and impersonating the accounts the
//! test names): no rule on any parent, child or related kind. Every object a policy reads or
//! writes is therefore read or written as the policy's account.

use std::time::Duration;

use anyhow::Context as _;
use kube::api::DynamicObject;
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

fn reconciled(object: &Value) -> Option<&Value> {
    condition(object, "Reconciled")
}

fn ready(policy: &Value) -> Option<&Value> {
    condition(policy, "Ready")
}

fn message(condition: Option<&Value>) -> String {
    condition
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned()
}

async fn install_kinds(client: &kube::Client) -> anyhow::Result<()> {
    install_repo_crds(client).await?;
    install_crd(client, &test_crd(TEST_GROUP, "Widget")).await
}

/// Role `name` in `ns` with `rules`, bound to ServiceAccount `account` of `ns`.
async fn role(
    client: &kube::Client,
    ns: &str,
    name: &str,
    account: &str,
    rules: Value,
) -> anyhow::Result<()> {
    bind_role(client, ns, name, rules, account_subject(ns, account)).await
}

/// The host's own rights, as the chart grants them: ReconcilePolicies and their status, and
/// NamespacedReconcilePolicies it turns into ReconcilePolicies (cluster-wide). Nothing on
/// any other kind; whom it may impersonate is granted apart.
async fn host_rights(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let mut rules = host_rights_but_namespaces();
    // Team policies are placed by their namespace's labels.
    rules.push(
        json!({"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]}),
    );
    bind_cluster_role(
        client,
        &format!("{ns}-host"),
        json!(rules),
        account_subject(ns, "host"),
    )
    .await
}

fn host_rights_but_namespaces() -> Vec<Value> {
    vec![
        json!({"apiGroups": ["wasmctrl.dev"], "resources": ["reconcilepolicies"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]}),
        json!({"apiGroups": ["wasmctrl.dev"], "resources": ["namespacedreconcilepolicies"], "verbs": ["get", "list", "watch", "patch"]}),
        json!({"apiGroups": ["wasmctrl.dev"], "resources": ["reconcilepolicies/status", "namespacedreconcilepolicies/status"], "verbs": ["get", "patch"]}),
    ]
}

/// Let ServiceAccount `host` of `host_ns` impersonate the accounts of `ns` named in
/// `accounts`, or (`None`) any account of `ns`.
async fn may_impersonate(
    client: &kube::Client,
    host_ns: &str,
    ns: &str,
    accounts: Option<&[&str]>,
) -> anyhow::Result<()> {
    let mut rule =
        json!({"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["impersonate"]});
    if let Some(accounts) = accounts {
        rule["resourceNames"] = json!(accounts);
    }
    let host = account_subject(host_ns, "host");
    bind_role(client, ns, "wasmctrl-impersonate", json!([rule]), host).await
}

/// What a policy's account needs on its parent kind (`group`, `plural`) in its namespace.
fn parent_rules(group: &str, plural: &str) -> Vec<Value> {
    vec![
        json!({"apiGroups": [group], "resources": [plural], "verbs": ["get", "list", "watch", "patch"]}),
        json!({"apiGroups": [group], "resources": [format!("{plural}/status")], "verbs": ["get", "patch"]}),
        json!({"apiGroups": [group], "resources": [format!("{plural}/finalizers")], "verbs": ["update"]}),
        json!({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}),
    ]
}

const CHILD_VERBS: [&str; 6] = ["get", "list", "watch", "create", "patch", "delete"];

async fn delete_cluster_rbac(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let name = format!("{ns}-host");
    for kind in ["ClusterRoleBinding", "ClusterRole"] {
        let api = kube::Api::<DynamicObject>::all_with(
            client.clone(),
            &resource("rbac.authorization.k8s.io", "v1", kind),
        );
        api.delete(&name, &Default::default()).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_acts_with_exactly_the_rights_of_its_service_account() -> anyhow::Result<()> {
    const TEST: &str = "tenancy-identity";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    for account in ["host", "narrow", "broad", "stranger"] {
        service_account(&client, &ns, account).await?;
    }
    // The host may act as `narrow` and `broad`, not as `stranger`.
    host_rights(&client, &ns).await?;
    may_impersonate(&client, &ns, &ns, Some(&["narrow", "broad"])).await?;
    // `narrow` may run the MyApp policy's Deployments but not its Services.
    let mut narrow = parent_rules("example.com", "myapps");
    narrow.push(json!({"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS}));
    narrow.push(
        json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}),
    );
    role(&client, &ns, "narrow", "narrow", json!(narrow)).await?;
    // `broad` may run the Widget policy, ConfigMaps as its children.
    let mut broad = parent_rules(TEST_GROUP, "widgets");
    broad.push(json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": CHILD_VERBS}));
    role(&client, &ns, "broad", "broad", json!(broad)).await?;

    let as_account = |account: &str, mut spec: Value| {
        spec["serviceAccount"] = json!({"namespace": ns, "name": account});
        spec
    };
    apply_policy(
        &client,
        TEST,
        "narrow",
        as_account(
            "narrow",
            myapp_policy_spec(file_source("myapp_plugin"), json!({"service": true})),
        ),
    )
    .await?;
    let widget_policy = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
    });
    apply_policy(
        &client,
        TEST,
        "broad",
        as_account("broad", widget_policy.clone()),
    )
    .await?;
    // A policy that names no account, and one that names an account the host may not use.
    let mut nobody = widget_policy.clone();
    nobody["parent"]["kind"] = json!("NoSuchKind");
    apply_policy(&client, TEST, "nobody", nobody.clone()).await?;
    apply_policy(&client, TEST, "stranger", as_account("stranger", nobody)).await?;

    let host = HostUnderTest::builder(TEST, &ns)
        .as_service_account(&ns, "host")
        .require_policy_identity()
        .start()
        .await?;
    let policy_api = policies(&client);

    // The narrow policy is refused before it watches anything, naming the account and
    // exactly what it lacks.
    let refused = wait_for_object(&policy_api, "narrow", "narrow: Forbidden", |p| {
        ready(p).is_some_and(|c| c["reason"] == "Forbidden")
    })
    .await?;
    let text = message(ready(&refused));
    assert!(
        text.contains(&format!("ServiceAccount {ns}/narrow may not"))
            && text.contains(&format!("services in namespace {ns}")),
        "{text}"
    );
    assert!(
        !text.contains("deployments"),
        "only what is missing: {text}"
    );

    // The broad policy, in the same host, runs as its account: the host itself may not touch
    // a ConfigMap, so the child exists only because the write was made as `broad`.
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w1", Some(1))).await?;
    wait_for_object(&widgets, "w1", "w1 reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    assert!(get(&config_maps, "w1-own").await?.is_some());
    let running = wait_for_object(&policy_api, "broad", "broad: Ready", |p| {
        ready(p).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    assert!(
        message(ready(&running)).contains(&format!("as ServiceAccount {ns}/broad")),
        "{running}"
    );

    // Without an identity, a host that requires one refuses the policy.
    let nobody = wait_for_object(&policy_api, "nobody", "nobody: IdentityRequired", |p| {
        ready(p).is_some_and(|c| c["reason"] == "IdentityRequired")
    })
    .await?;
    assert!(
        message(ready(&nobody)).contains("spec.serviceAccount"),
        "{nobody}"
    );
    // An account the host may not impersonate is named, with the grant it needs.
    let stranger = wait_for_object(
        &policy_api,
        "stranger",
        "stranger: ImpersonationForbidden",
        |p| ready(p).is_some_and(|c| c["reason"] == "ImpersonationForbidden"),
    )
    .await?;
    assert!(
        message(ready(&stranger)).contains(&format!("ServiceAccount {ns}/stranger")),
        "{stranger}"
    );
    // Neither had its plugin fetched: whom a policy acts as is settled first.
    for refused in [&nobody, &stranger] {
        assert!(refused["status"]["activeDigest"].is_null(), "{refused}");
        let loaded = condition(refused, "PluginLoaded");
        assert!(
            loaded.is_some_and(|c| c["status"] == "False" && c["reason"] == "IdentityPending"),
            "{refused}"
        );
    }

    // Take away `broad`'s right to create ConfigMaps (it may still read them): the plugin's
    // next child fails with a reason that says so, and nothing is created.
    let mut reading = parent_rules(TEST_GROUP, "widgets");
    reading.push(
        json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}),
    );
    role(&client, &ns, "broad", "broad", json!(reading)).await?;
    apply(&widgets, widget("w2", Some(2))).await?;
    let failed = wait_for_object(&widgets, "w2", "w2 failed", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "False")
    })
    .await?;
    let text = message(reconciled(&failed));
    assert!(
        text.contains("forbidden") && text.contains("configmaps"),
        "{failed}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(get(&config_maps, "w2-own").await?.is_none());
    // What the account made before is left alone.
    assert!(get(&config_maps, "w1-own").await?.is_some());

    host.stop().await?;
    for name in ["narrow", "broad", "nobody", "stranger"] {
        policy_api.delete(name, &Default::default()).await?;
    }
    delete_cluster_rbac(&client, &ns).await?;
    delete_namespace(&client, &ns).await
}

/// What a cluster admin grants a team, in its namespace only: its own policies, its parent
/// kind, the kinds its operator makes, ServiceAccounts and RBAC to give its operator an
/// identity. No cluster rights at all.
async fn onboard_team(client: &kube::Client, ns: &str, user: &str) -> anyhow::Result<()> {
    bind_role(
        client,
        ns,
        "team",
        json!([
            {"apiGroups": ["wasmctrl.dev"], "resources": ["namespacedreconcilepolicies", "namespacedreconcilepolicies/status"], "verbs": ["*"]},
            {"apiGroups": ["example.com"], "resources": ["myapps", "myapps/status", "myapps/finalizers"], "verbs": ["*"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]},
            {"apiGroups": [""], "resources": ["services", "configmaps", "serviceaccounts"], "verbs": ["*"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["*"]},
            {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": ["*"]},
        ]),
        json!({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}),
    )
    .await
}

/// What the team does itself, as `user`: an account for its operator with the rights the
/// MyApp policy needs, the policy (plugin over HTTP from `plugin_url`), and a MyApp.
async fn team_runs_myapp(
    ns: &str,
    user: &str,
    plugin_url: &str,
    digest: &str,
    label: &str,
) -> anyhow::Result<kube::Client> {
    let team = client_as(user).await?;
    service_account(&team, ns, "operator").await?;
    let mut rules = parent_rules("example.com", "myapps");
    rules.push(json!({"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS}));
    rules.push(json!({"apiGroups": [""], "resources": ["services"], "verbs": CHILD_VERBS}));
    rules.push(
        json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}),
    );
    role(&team, ns, "operator", "operator", json!(rules)).await?;
    let mut spec = myapp_policy_spec(
        json!({"http": {"url": plugin_url}}),
        json!({"service": true}),
    );
    spec["plugin"]["digest"] = json!(digest);
    spec["serviceAccount"] = json!({"namespace": ns, "name": "operator"});
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
        "metadata": {"name": "myapp", "labels": {TEST_LABEL: label}},
        "spec": spec,
    });
    apply(&namespaced_policies(&team, ns), policy).await?;
    apply(&myapps(&team, ns), myapp("web", 2, "nginx:1.27", None)).await?;
    Ok(team)
}

const TEAMS: &str = "tenancy-teams";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_with_only_namespace_rights_run_their_own_operators_for_one_parent_kind()
-> anyhow::Result<()> {
    let (client, host_ns) = test_namespace(TEAMS).await?;
    let (_, team_a) = test_namespace("tenancy-team-a").await?;
    let (_, team_b) = test_namespace("tenancy-team-b").await?;
    // The admin places both teams with this host.
    for team in [&team_a, &team_b] {
        place_namespace(&client, team, TEAMS).await?;
    }
    install_repo_crds(&client).await?;
    // The host: its own rights, and impersonating any account of the two teams' namespaces
    // (the chart's `policyIdentity.namespaces`).
    service_account(&client, &host_ns, "host").await?;
    host_rights(&client, &host_ns).await?;
    for team in [&team_a, &team_b] {
        may_impersonate(&client, &host_ns, team, None).await?;
        onboard_team(&client, team, &format!("{team}-user")).await?;
    }
    // Served until the test ends (the server stops when dropped).
    let server = serve_plugins(None)?;
    // Teams may ask for 256 MiB a call and 16 reconciles at once, and fetch only from it.
    let host = HostUnderTest::cluster_wide(TEAMS)
        .as_service_account(&host_ns, "host")
        .require_policy_identity()
        .team_bounds(wasmctrl::policy::namespaced::TeamBounds {
            max_memory_mib: Some(256),
            max_concurrent_reconciles: Some(16),
            source_hosts: Some(vec![server.address.to_string()]),
        })
        .start()
        .await?;

    // Each team, as a user with rights in its namespace only, runs the MyApp operator.
    let (url, digest) = myapp_plugin_url(server.address)?;
    let mut teams = Vec::new();
    for team in [&team_a, &team_b] {
        let user = format!("{team}-user");
        let team_client = team_runs_myapp(team, &user, &url, &digest, TEAMS).await?;
        // It could not have made a cluster-wide policy.
        let denied = policies(&team_client)
            .create(
                &Default::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
                    "metadata": {"name": format!("{team}-sneaky")},
                    "spec": myapp_policy_spec(file_source("myapp_plugin"), json!({})),
                }))?,
            )
            .await;
        assert!(
            matches!(&denied, Err(kube::Error::Api(status)) if status.code == 403),
            "{denied:?}"
        );
        teams.push((team.clone(), team_client));
    }
    // Both run, side by side, for the same parent kind: each reconciled its own MyApp, and
    // each policy's state is on the policy the team made.
    for (team, team_client) in &teams {
        let deployments = api(team_client, &resource("apps", "v1", "Deployment"), team);
        wait_for_object(
            &deployments,
            "web",
            &format!("{team}: web's Deployment"),
            |d| d["spec"]["replicas"] == 2,
        )
        .await?;
        let policy = wait_for_object(
            &namespaced_policies(team_client, team),
            "myapp",
            &format!("{team}: policy Ready"),
            |p| {
                ready(p).is_some_and(|c| c["status"] == "True")
                    && p["status"]["observedGeneration"] == p["metadata"]["generation"]
            },
        )
        .await?;
        assert!(
            message(ready(&policy)).contains(&format!("as ServiceAccount {team}/operator")),
            "{policy}"
        );
    }

    // A policy that reaches outside its namespace is refused where the team can read why.
    let (team, team_client) = &teams[0];
    let mut outside = myapp_policy_spec(json!({"http": {"url": url}}), json!({}));
    outside["plugin"]["digest"] = json!(digest);
    outside["serviceAccount"] = json!({"namespace": team_b, "name": "operator"});
    apply(
        &namespaced_policies(team_client, team),
        json!({"apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
               "metadata": {"name": "borrowed", "labels": {TEST_LABEL: TEAMS}},
               "spec": outside}),
    )
    .await?;
    wait_for_object(
        &namespaced_policies(team_client, team),
        "borrowed",
        "borrowed: IdentityOutsideNamespace",
        |p| ready(p).is_some_and(|c| c["reason"] == "IdentityOutsideNamespace"),
    )
    .await?;
    // So is one asking for more than the admin lets a team, or fetching from elsewhere.
    let elsewhere = format!(
        "http://127.0.0.2:{}/myapp_plugin.wasm",
        server.address.port()
    );
    for (name, limits, source, reason) in [
        (
            "greedy",
            json!({"memoryMib": 1024}),
            json!({"http": {"url": url}}),
            "OverTeamLimit",
        ),
        (
            "elsewhere",
            json!({}),
            json!({"http": {"url": elsewhere}}),
            "SourceHostNotAllowed",
        ),
    ] {
        let mut spec = myapp_policy_spec(source, json!({}));
        spec["plugin"]["digest"] = json!(digest);
        spec["limits"] = limits;
        spec["serviceAccount"] = json!({"namespace": team, "name": "operator"});
        apply(
            &namespaced_policies(team_client, team),
            json!({"apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
                   "metadata": {"name": name, "labels": {TEST_LABEL: TEAMS}},
                   "spec": spec}),
        )
        .await?;
        wait_for_object(
            &namespaced_policies(team_client, team),
            name,
            &format!("{name}: {reason}"),
            |p| ready(p).is_some_and(|c| c["reason"] == reason),
        )
        .await?;
    }
    let cluster_policies = policies(&client);
    for refused in ["borrowed", "greedy", "elsewhere"] {
        assert!(
            get(&cluster_policies, &format!("{team}.{refused}"))
                .await?
                .is_none(),
            "{refused} was made"
        );
    }

    // Deleting its policy takes the policy the host made with it.
    for (team, team_client) in &teams {
        for policy in ["myapp", "borrowed", "greedy", "elsewhere"] {
            let _ = namespaced_policies(team_client, team)
                .delete(policy, &Default::default())
                .await;
        }
        wait_gone(
            &namespaced_policies(team_client, team),
            "myapp",
            "the team's policy",
        )
        .await?;
        wait_gone(
            &cluster_policies,
            &format!("{team}.myapp"),
            "the policy made from it",
        )
        .await?;
    }
    host.stop().await?;
    delete_cluster_rbac(&client, &host_ns).await?;
    for ns in [&team_a, &team_b, &host_ns] {
        delete_namespace(&client, ns).await?;
    }
    Ok(())
}

/// Remove `name`'s finalizers by hand, as an admin does when a host is gone, and delete it.
async fn delete_past_its_finalizer(
    sources: &kube::Api<DynamicObject>,
    name: &str,
) -> anyhow::Result<()> {
    sources
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    sources.delete(name, &Default::default()).await?;
    wait_gone(sources, name, "the team's policy, its finalizer removed").await
}

/// A watch the host may not list (here: namespaces, as when an admin has not yet granted
/// them, or the API server's authorizer has not yet seen the grant) must not stall the team
/// policies: neither a reconcile waiting for the namespaces' labels (it held the policy for
/// 30 s, and a deletion, which needs no labels, waited behind it), nor kube-runtime's backoff
/// of the merged watch stream on every error (to 30 s and beyond).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_the_host_may_not_list_does_not_stall_the_team_policies() -> anyhow::Result<()> {
    const TEST: &str = "tenancy-refused-watch";
    let (client, host_ns) = test_namespace(TEST).await?;
    let (_, team) = test_namespace("tenancy-refused-watch-team").await?;
    place_namespace(&client, &team, TEST).await?;
    install_repo_crds(&client).await?;
    service_account(&client, &host_ns, "host").await?;
    bind_cluster_role(
        &client,
        &format!("{host_ns}-host"),
        json!(host_rights_but_namespaces()),
        account_subject(&host_ns, "host"),
    )
    .await?;
    // A team policy a host once took: it carries the host's finalizer.
    let sources = namespaced_policies(&client, &team);
    let mut spec = myapp_policy_spec(
        json!({"http": {"url": "http://127.0.0.1:9/myapp.wasm"}}),
        json!({}),
    );
    spec["plugin"]["digest"] = json!(format!("sha256:{}", "0".repeat(64)));
    spec["serviceAccount"] = json!({"namespace": team, "name": "operator"});
    apply(
        &sources,
        json!({
            "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
            "metadata": {"name": "myapp", "finalizers": ["wasmctrl.dev/namespaced-policy"]},
            "spec": spec,
        }),
    )
    .await?;
    let running = HostUnderTest::cluster_wide(TEST)
        .as_service_account(&host_ns, "host")
        .start()
        .await?;
    // Long enough for the namespace list to be refused several times, and a reconcile of
    // the policy to be waiting for it.
    tokio::time::sleep(Duration::from_secs(8)).await;
    sources.delete("myapp", &Default::default()).await?;
    eventually(
        "the deleted team policy's finalizer released, though namespaces cannot be listed",
        Duration::from_secs(3),
        || async { Ok(get(&sources, "myapp").await?.is_none()) },
    )
    .await?;
    running.stop().await?;
    delete_cluster_rbac(&client, &host_ns).await?;
    for ns in [&team, &host_ns] {
        delete_namespace(&client, ns).await?;
    }
    Ok(())
}

const ORPHANS: &str = "tenancy-orphans";

/// A team policy that went without the host seeing it (its finalizer removed while no host
/// ran) leaves a ReconcilePolicy no owner reference can collect: the host collects it, and a
/// new team policy of the same name runs instead of being refused as `NameTaken`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_made_from_a_team_policy_that_is_gone_is_collected() -> anyhow::Result<()> {
    let (client, host_ns) = test_namespace(ORPHANS).await?;
    let (_, team) = test_namespace("tenancy-orphans-team").await?;
    place_namespace(&client, &team, ORPHANS).await?;
    install_repo_crds(&client).await?;
    service_account(&client, &host_ns, "host").await?;
    host_rights(&client, &host_ns).await?;
    may_impersonate(&client, &host_ns, &team, None).await?;
    let user = format!("{team}-user");
    onboard_team(&client, &team, &user).await?;
    let host = || {
        HostUnderTest::cluster_wide(ORPHANS)
            .as_service_account(&host_ns, "host")
            .require_policy_identity()
            .start()
    };
    // Served until the test ends (the server stops when dropped).
    let server = serve_plugins(None)?;
    let (url, digest) = myapp_plugin_url(server.address)?;
    let sources = namespaced_policies(&client, &team);
    let cluster_policies = policies(&client);
    let made_name = format!("{team}.myapp");
    let runs = |phase: &'static str| {
        let sources = sources.clone();
        async move {
            wait_for_object(&sources, "myapp", phase, |p| {
                ready(p).is_some_and(|c| c["status"] == "True")
            })
            .await
        }
    };
    let made_from =
        |policy: &Value| policy["metadata"]["labels"]["wasmctrl.dev/namespaced-policy-uid"].clone();

    let running = host().await?;
    team_runs_myapp(&team, &user, &url, &digest, ORPHANS).await?;
    runs("the team's policy runs").await?;
    running.stop().await?;

    // Gone while no host ran: the next host collects what was made from it.
    delete_past_its_finalizer(&sources, "myapp").await?;
    assert!(get(&cluster_policies, &made_name).await?.is_some());
    let running = host().await?;
    wait_gone(
        &cluster_policies,
        &made_name,
        "the orphaned ReconcilePolicy",
    )
    .await?;

    // Made anew under the same name while no host ran: it replaces the old one.
    team_runs_myapp(&team, &user, &url, &digest, ORPHANS).await?;
    let first = runs("the team's policy runs again").await?;
    running.stop().await?;
    delete_past_its_finalizer(&sources, "myapp").await?;
    team_runs_myapp(&team, &user, &url, &digest, ORPHANS).await?;
    let second = get(&sources, "myapp").await?.context("the new policy")?;
    assert_ne!(first["metadata"]["uid"], second["metadata"]["uid"]);
    let running = host().await?;
    let made = wait_for_object(
        &cluster_policies,
        &made_name,
        "the ReconcilePolicy made from the new team policy",
        |p| made_from(p) == second["metadata"]["uid"],
    )
    .await?;
    let policy = runs("the new team policy runs, not refused as NameTaken").await?;
    assert_eq!(made_from(&made), policy["metadata"]["uid"]);

    sources.delete("myapp", &Default::default()).await?;
    wait_gone(&cluster_policies, &made_name, "the policy made from it").await?;
    running.stop().await?;
    delete_cluster_rbac(&client, &host_ns).await?;
    for ns in [&team, &host_ns] {
        delete_namespace(&client, ns).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_policy_that_never_ran_does_not_keep_an_admins_policy_from_its_kind()
-> anyhow::Result<()> {
    const TEST: &str = "tenancy-claims";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // The team's policy for Widgets comes first, acting as an account that does not exist.
    let mut spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": {"oci": {"reference": "registry.example.com/widgets:1"}}, "digest": format!("sha256:{}", "0".repeat(64))},
    });
    spec["serviceAccount"] = json!({"namespace": ns, "name": "nobody"});
    apply(
        &namespaced_policies(&client, &ns),
        json!({"apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
               "metadata": {"name": "claim", "labels": {TEST_LABEL: TEST}},
               "spec": spec}),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    let made = format!("{ns}.claim");
    wait_for_object(&policy_api, &made, "the team's policy refused", |p| {
        ready(p).is_some_and(|c| c["status"] == "False")
    })
    .await?;
    // Creation times have one-second resolution.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // The admin's cluster policy for the same kind, made later, runs.
    apply_policy(
        &client,
        TEST,
        "tenancy-claims-admin",
        json!({
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "plugin": {"source": file_source("misbehave_plugin")},
        }),
    )
    .await?;
    let running = wait_for_object(
        &policy_api,
        "tenancy-claims-admin",
        "the admin's policy runs",
        |p| ready(p).is_some_and(|c| c["status"] == "True" || c["reason"] == "ParentKindTaken"),
    )
    .await?;
    assert_eq!(
        ready(&running).map(|c| c["status"].clone()),
        Some(json!("True")),
        "{}",
        message(ready(&running))
    );

    host.stop().await?;
    namespaced_policies(&client, &ns)
        .delete("claim", &Default::default())
        .await?;
    policy_api
        .delete("tenancy-claims-admin", &Default::default())
        .await?;
    delete_namespace(&client, &ns).await
}

/// Which host runs a team's policy is the admin's decision: the namespace's labels place it,
/// and a label the team puts on its policy to move it to a host without a verify floor moves
/// nothing. The host the namespace is placed with refuses the unsigned plugin; the other
/// never runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_label_does_not_move_its_policy_to_a_host_without_a_verify_floor()
-> anyhow::Result<()> {
    const TEST: &str = "tenancy-placement";
    const LAX: &str = "tenancy-placement-lax";
    // Labelled by the admin for the strict host (TEST).
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    service_account(&client, &ns, "operator").await?;
    role(
        &client,
        &ns,
        "operator",
        "operator",
        json!([
            {"apiGroups": [TEST_GROUP], "resources": ["widgets", "widgets/status", "widgets/finalizers"], "verbs": ["get", "list", "watch", "patch", "update"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": CHILD_VERBS},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ]),
    )
    .await?;
    let key = wasmctrl::signing::sign::SigningKey::generate()?;
    let floor = wasmctrl::policy::VerifySpec {
        keys: vec![key.public_pem()?],
        ..Default::default()
    };
    let strict = HostUnderTest::builder(TEST, &ns)
        .plugin_verify(floor)
        .start()
        .await?;
    let lax = HostUnderTest::builder(LAX, &ns).start().await?;

    let server = serve_plugins(None)?;
    let plugin = std::fs::read(wasmctrl_testenv::plugins::guest("misbehave_plugin"))?;
    let spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {
            "source": {"http": {"url": format!("http://{}/misbehave_plugin.wasm", server.address)}},
            "digest": wasmctrl::plugin::Digest::of(&plugin).to_string(),
            "config": {"ownChild": true},
        },
        "serviceAccount": {"namespace": ns, "name": "operator"},
    });
    let sources = namespaced_policies(&client, &ns);
    apply(
        &sources,
        json!({"apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
               "metadata": {"name": "unsigned", "labels": {TEST_LABEL: LAX}},
               "spec": spec}),
    )
    .await?;
    apply(&widgets(&client, &ns), widget("w", Some(1))).await?;

    let policy_api = policies(&client);
    let made = format!("{ns}.unsigned");
    let refused = wait_for_object(&policy_api, &made, "the unsigned plugin refused", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    assert_eq!(
        refused["metadata"]["labels"][TEST_LABEL], TEST,
        "placed by the namespace's label: {refused}"
    );
    let message = message(condition(&refused, "PluginLoaded"));
    assert!(message.contains("sign"), "{message}");
    wait_for_object(&sources, "unsigned", "the team told", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    // Neither host made the Widget's child: the lax host never ran the policy.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        get(
            &api(&client, &resource("", "v1", "ConfigMap"), &ns),
            "w-own"
        )
        .await?
        .is_none(),
        "the unsigned plugin ran"
    );

    // The admin moves the namespace to the lax host: its policy follows.
    place_namespace(&client, &ns, LAX).await?;
    wait_for_object(&policy_api, &made, "the policy moved", |p| {
        p["metadata"]["labels"][TEST_LABEL] == LAX
            && condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    wasmctrl_testenv::cluster::eventually("the child made", Duration::from_secs(30), || async {
        Ok(get(
            &api(&client, &resource("", "v1", "ConfigMap"), &ns),
            "w-own",
        )
        .await?
        .is_some())
    })
    .await?;

    // The team's policy goes (its finalizer lets the made policy go first) before the hosts.
    sources.delete("unsigned", &Default::default()).await?;
    wasmctrl_testenv::cluster::eventually(
        "the team's policy gone",
        Duration::from_secs(30),
        || async {
            Ok(get(&sources, "unsigned").await?.is_none()
                && get(&policy_api, &made).await?.is_none())
        },
    )
    .await?;
    strict.stop().await?;
    lax.stop().await?;
    delete_namespace(&client, &ns).await
}

/// `wasmctrl rollout … NAMESPACE/NAME` as the team runs it, with only its namespace's
/// rights: each command changes the team's own policy, which the host carries to the policy
/// it made; the made policy itself is refused, naming the team's.
async fn team_rollout(team_client: &kube::Client, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["wasmctrl", "rollout"];
    all.extend_from_slice(args);
    match <wasmctrl::cli::Cli as clap::Parser>::try_parse_from(all)?.command {
        wasmctrl::cli::Command::Rollout(command) => command.report_with(team_client).await,
        _ => anyhow::bail!("not a rollout command"),
    }
}

const TEAM_ROLLOUT: &str = "tenancy-team-rollout";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_operates_its_rollout_with_commands_on_its_own_policy() -> anyhow::Result<()> {
    let (client, host_ns) = test_namespace(TEAM_ROLLOUT).await?;
    let (_, team) = test_namespace("tenancy-rollout-team").await?;
    place_namespace(&client, &team, TEAM_ROLLOUT).await?;
    install_repo_crds(&client).await?;
    service_account(&client, &host_ns, "host").await?;
    host_rights(&client, &host_ns).await?;
    may_impersonate(&client, &host_ns, &team, None).await?;
    let user = format!("{team}-user");
    onboard_team(&client, &team, &user).await?;
    let host = HostUnderTest::cluster_wide(TEAM_ROLLOUT)
        .as_service_account(&host_ns, "host")
        .require_policy_identity()
        .start()
        .await?;
    let server = serve_plugins(None)?;
    let (url, digest) = myapp_plugin_url(server.address)?;
    let team_client = team_runs_myapp(&team, &user, &url, &digest, TEAM_ROLLOUT).await?;
    let sources = namespaced_policies(&team_client, &team);
    wait_for_object(&sources, "myapp", "the team's policy runs", |p| {
        ready(p).is_some_and(|c| c["status"] == "True")
    })
    .await?;

    // A candidate with a rollout that stays in shadow until promoted by hand.
    let v2 = wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
        "myapp_v2_plugin",
    ))?)
    .to_string();
    sources
        .patch(
            "myapp",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"plugin": {
                "candidate": {"source": {"http": {"url": format!("http://{}/myapp_v2_plugin.wasm", server.address)}}, "digest": v2},
                "rollout": {"stages": [{"percent": 0, "soakSeconds": 3600, "maxWouldChange": 1.0}]},
            }}})),
        )
        .await?;
    let policy = format!("{team}/myapp");
    let made_name = format!("{team}.myapp");
    let made = policies(&client);
    wait_for_object(
        &made,
        &made_name,
        "the made policy's rollout started",
        |p| p["status"]["rollout"]["phase"].is_string(),
    )
    .await?;
    let shown: Value = serde_json::from_str(
        &team_rollout(&team_client, &["status", &policy, "-o", "json"]).await?,
    )?;
    assert_eq!(shown["candidate"]["digest"], v2.as_str(), "{shown}");

    // pause: the team's own field, carried to the made policy.
    team_rollout(&team_client, &["pause", &policy]).await?;
    let source = get(&sources, "myapp").await?.context("the team's policy")?;
    assert_eq!(source["spec"]["plugin"]["rollout"]["paused"], true);
    wait_for_object(&made, &made_name, "paused on the made policy", |p| {
        p["spec"]["plugin"]["rollout"]["paused"] == true
    })
    .await?;

    // The made policy is refused, naming the team's.
    let refused = team_rollout(&client, &["resume", &made_name]).await;
    let said = refused.err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(said.contains(&format!("operate `{policy}`")), "{said}");

    // abort: the candidate leaves the team's policy and the made one.
    team_rollout(&team_client, &["abort", &policy]).await?;
    let source = get(&sources, "myapp").await?.context("the team's policy")?;
    assert!(source["spec"]["plugin"]["candidate"].is_null(), "{source}");
    assert!(source["spec"]["plugin"]["rollout"].is_null(), "{source}");
    wait_for_object(
        &made,
        &made_name,
        "the candidate gone from the made policy",
        |p| p["spec"]["plugin"]["candidate"].is_null(),
    )
    .await?;

    sources.delete("myapp", &Default::default()).await?;
    wait_gone(&made, &made_name, "the policy made from it").await?;
    host.stop().await?;
    delete_cluster_rbac(&client, &host_ns).await?;
    for ns in [&team, &host_ns] {
        delete_namespace(&client, ns).await?;
    }
    Ok(())
}
